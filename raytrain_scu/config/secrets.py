"""Credentials stay out of the config. Pure: no I/O.

The rule (docs/reliability.md, "Secrets"): a config value that carries a credential is refused before anything runs,
and the error names the environment variable that carries it instead. A credential is a password in a URI's user part
(``https://user:password@host``, ``s3://KEY_ID:SECRET@bucket``, a nested ``endpoint_override=http://u:p@host``), a
query parameter named like a secret (``secret_key=``, ``access_key=``, ``token=``, ``password=``), or a Hugging Face
token (``hf_...``). A key named like a secret does not exist in the schema and is refused as such, naming the variable
too. Anything that reaches a message or a dump anyway is masked by :func:`redact_uri` (the second line of defence).
"""
from __future__ import annotations

import re
from typing import Optional

from raytrain_scu.errors import ConfigError

# a key's or a query parameter's name is secret when one of its words (split at _ . -) is one of these ("key": an API
# key given as ?key=), or two neighbouring words are one of the pairs; the one rule for refusing and for masking
SECRET_WORDS = frozenset({"token", "password", "passwd", "pwd", "secret", "credential", "credentials", "apikey",
                          "key"})
SECRET_PAIRS = frozenset({"api_key", "access_key", "secret_key", "private_key", "session_token"})

_USERINFO_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://[^/@\s?#:]*:[^/@\s?#]+@")
_QUERY_PARAM = re.compile(r"[?&]([^=&\s]+)=([^&\s]*)")
HF_TOKEN_PATTERN = re.compile(r"\bhf_[A-Za-z0-9]{30,}")

AWS_ENV = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN for temporary credentials)"
MLFLOW_ENV = "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"
HF_ENV = "HF_TOKEN"
ENV_BY_SCHEME = {"s3": AWS_ENV, "gs": "GOOGLE_APPLICATION_CREDENTIALS", "gcs": "GOOGLE_APPLICATION_CREDENTIALS",
                 "postgresql": "PGPASSWORD", "mysql": "MYSQL_PWD", "http": MLFLOW_ENV, "https": MLFLOW_ENV,
                 "databricks": "DATABRICKS_TOKEN"}
ANY_ENV = f"{AWS_ENV} for S3, {MLFLOW_ENV} for an MLflow server, {HF_ENV} for the Hugging Face Hub"


def redact_uri(uri: str) -> str:
    """``scheme://user:password@host`` -> ``scheme://user:***@host``, query-string secrets and Hugging Face tokens
    masked: for what reaches a message, a dump or a param although the config refuses credentials (an exception's
    text, a CLI argument)."""
    uri = re.sub(r"(://[^/:@\s]+):[^/@\s]+@", r"\1:***@", uri)
    uri = HF_TOKEN_PATTERN.sub("hf_***", uri)
    # every query parameter the refusal counts as a secret (secret_name), so its message shows none
    return _QUERY_PARAM.sub(lambda m: m.group(0)[:1] + f"{m.group(1)}=***" if m.group(2) and secret_name(m.group(1))
                            else m.group(0), uri)


def secret_name(name: str) -> bool:
    """Whether a key's or a query parameter's name says it holds a secret (``password``, ``secret_key``,
    ``hf_token``; not ``tokenizer`` or ``tokens_per_epoch``)."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    pairs = {f"{a}_{b}" for a, b in zip(words, words[1:])}
    return bool(SECRET_WORDS.intersection(words) or SECRET_PAIRS & pairs)


def _scheme(value: str) -> str:
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", value)
    return m.group(1).lower().split("+")[0] if m else ""  # postgresql+psycopg2 -> postgresql


def env_for(key: str, value: str = "") -> str:
    """The environment variable(s) that carry the credential a config ``key`` (with ``value``) would hold."""
    scheme = _scheme(value)
    if HF_TOKEN_PATTERN.search(value) or (key.startswith("model.") and scheme not in ("s3", "gs", "gcs")):
        return HF_ENV
    if "endpoint_override" in value or scheme == "s3" or any(p in key.lower() for p in ("aws", "s3")):
        return AWS_ENV
    if key.startswith("tracking."):
        return ENV_BY_SCHEME.get(scheme, MLFLOW_ENV)
    return ENV_BY_SCHEME.get(scheme, ANY_ENV)


def credential_in(value: str) -> Optional[str]:
    """What credential ``value`` carries, in words (never the credential itself); None when it carries none. A part
    :func:`redact_uri` masked (``***``, in a dump read back) carries none."""
    if _USERINFO_PASSWORD.search(value.replace(":***@", "@")):
        return "a password in a URI's user part"
    names = [name for name, v in _QUERY_PARAM.findall(value) if v not in ("", "***") and secret_name(name)]
    if names:
        return f"a secret in its query ({', '.join(f'{n}=' for n in names)})"
    if HF_TOKEN_PATTERN.search(value):
        return "a Hugging Face token"
    return None


def refuse_secret_key(key: str) -> None:
    """A config key named like a secret (``tracking.password``): no such key exists, and the error says where the
    secret goes instead."""
    if secret_name(key.rsplit(".", 1)[-1]):
        raise ConfigError(f"{key}: there is no config key for a secret, and secrets are never read from the config "
                          f"(they would be written to every dump, param and log): set {env_for(key)} in the "
                          f"environment of the driver and the Ray nodes instead")


def refuse_credential(key: str, value: str) -> None:
    """Refuse ``value`` of ``key`` (a config key, or a CLI flag that names storage) when it carries a credential,
    naming the key, the value with the credential masked, what it carries and the environment variable to use."""
    what = credential_in(value)
    if what:
        raise ConfigError(f"{key}: {redact_uri(value)!r} holds {what}; credentials are never taken from the "
                          f"config or the command line (they would be written to every dump, param and log): take "
                          f"them out of the value and set {env_for(key, value)} in the environment of the driver "
                          f"and the Ray nodes instead")


def refuse_credentials(flat: dict) -> None:
    """:func:`refuse_credential` for every string value of a flat config (``{dotted key: value}``)."""
    for key, value in flat.items():
        if isinstance(value, str):
            refuse_credential(key, value)
