"""No silent no-op gains: a key of a law that no run of a config uses is refused, in the config as written, in
tune.space and in each trial's values, naming the key and what to do. Pure: no I/O, no heavy imports."""
from __future__ import annotations

from typing import Any

from raytrain_scu.config.io import get_dotted
from raytrain_scu.config.schema import ARM, LAW_KEYS, Config
from raytrain_scu.errors import ConfigError

_KEY_LAW = {key: law for law, keys in LAW_KEYS.items() for key in keys}
# a law's key -> the other law's key that does the same job, named in a refusal
_COUNTERPART = {"controller.kp": "controller.logodds_kp", "controller.ki": "controller.logodds_ki",
                "controller.ema_alpha": "controller.logodds_data_alpha"}
_COUNTERPART.update({v: k for k, v in _COUNTERPART.copy().items()})


def _foreign(keys, laws: set[str]) -> list[str]:
    """The keys among ``keys`` that belong to a law not in ``laws``, in order."""
    return [k for k in keys if k in _KEY_LAW and _KEY_LAW[k] not in laws]


def _listed(spec: Any) -> list:
    """The values of a choice or grid entry of tune.space; [] for a range (or a malformed entry, refused elsewhere)."""
    if not (isinstance(spec, dict) and len(spec) == 1):
        return []
    (kind, args), = spec.items()
    return list(args) if kind in ("choice", "grid") and isinstance(args, list) else []


def trial_laws(law: str, space: dict) -> tuple[set[str], list[set[str]]]:
    """The laws the runs of a config use, as ``(base, [each arm's])``: base is the values of a tune.space entry over
    controller.law, else ``law`` (controller.law); an arm runs its own controller.law, else the base's."""
    base = {v for v in _listed(space.get("controller.law")) if isinstance(v, str)} or {law}
    arms = [a for a in _listed(space.get(ARM)) if isinstance(a, dict)]
    return base, [{a["controller.law"]} if "controller.law" in a else base for a in arms]


def _unused(where: str, what: str, key: str, runs: str, fix: str, instead: str) -> ConfigError:
    """The refusal of ``key`` at ``where`` (``what``: how it is set there), whose law ``runs`` says no run uses: ``fix``
    names the key's law (``{law}``), then ``instead`` the other law's key that does the same job (``{key}``), if any."""
    law = _KEY_LAW[key]
    fix = fix.format(law=law) + (f", or {instead.format(key=_COUNTERPART[key])}" if key in _COUNTERPART else "")
    return ConfigError(f"{where}: {what + ' ' if what else ''}a key of the {law} law, but {runs}, so it changes "
                       f"nothing: {fix}")


def _running(law: str, space: dict) -> tuple[set[str], str, str]:
    """The laws some run of a config uses (:func:`trial_laws`), the words a refusal says it with, and the start of the
    fix it names (``{law}``: the refused key's law)."""
    base, arms = trial_laws(law, space)
    running = set().union(*arms) if arms else base
    if running == {law}:
        return running, f"controller.law is {law}", "set controller.law={law}"
    return (running, f"every run of this config uses the {' or '.join(sorted(running))} law (tune.space sets the law)",
            "run the {law} law in tune.space")


def check_space_laws(law: str, space: dict) -> None:
    """Refuse a tune.space entry over a key of a law that no trial runs, and an arm that sets a key of a law other
    than the one it runs (:func:`trial_laws`; ``law``: controller.law): ConfigError naming the entry and what to do.
    Pure."""
    running, runs, fix = _running(law, space)
    for key in _foreign(space, running):
        raise _unused(f"tune.space.{key}", "sweeps", key, runs, fix + " to sweep it", "sweep {key} instead")
    for i, (arm, laws) in enumerate(zip(_listed(space.get(ARM)), trial_laws(law, space)[1])):
        for key in _foreign(arm, laws):
            raise _unused(f"tune.space.{ARM}[{i}]", f"sets {key},", key,
                          f"this arm runs the {' or '.join(sorted(laws))} law",
                          "set controller.law={law} in the arm to use it", "set {key} instead")


def check_law_keys(cfg: Config, explicit: set[str]) -> None:
    """No silent no-op gains: refuse a key of a law that no run of ``cfg`` uses (ConfigError naming the key and what
    to do), where ``explicit`` (the keys the YAML file and overrides set) sets one to other than its default, or
    tune.space sweeps one, or an arm sets one for a law other than its own (:func:`check_space_laws`).

    The laws a config's runs use are its controller.law, or the values of a tune.space entry over it, and each arm's
    own controller.law (:func:`trial_laws`). The rule is by law, not by mode: mode fixed or none runs no law, but a
    sweep's or study's arms set the mode per trial on one base config (the ablations' none, fixed and scu arms), so
    the gains of the config's own law are read by some of its runs whatever the base's mode.

    Where controller.law is set too, a key at its default passes: a full config (``python -m raytrain_scu.config``'s
    output, a run's saved config.yaml) sets every key, and a default changes nothing it would not change unset. Where
    the law is left to its default, any key of another law is refused, whatever its value: a file written for that
    law (its gains at their defaults included) would otherwise run the default law silently. Run by
    ``driver.resolve`` on the config as written, and not by :func:`validate`, which also runs on each trial's config:
    there an arm's law has replaced the base's, which the other arms still run.
    """
    running, runs, fix = _running(cfg.controller.law, cfg.tune.space)
    default = Config()
    for key in sorted(_foreign(explicit, running)):
        value = get_dotted(cfg, key)
        if "controller.law" not in explicit or value != get_dotted(default, key):
            raise _unused(f"{key}={value}", "", key, runs, fix + " to use it", "tune {key} instead")
    check_space_laws(cfg.controller.law, cfg.tune.space)


def check_trial_law(law: str, params: dict) -> None:
    """One trial's values against the law it runs (``law``, after its values are applied): a key of another law is a
    ConfigError. ``resolve_space`` refuses such a space before launch; a restored Tune experiment keeps the space it
    was started with, which this check meets in the trial instead. A trial whose values set controller.law comes from
    a space that sweeps the law (or an arm that sets it), whose keys :func:`check_space_laws` judged: it passes."""
    if "controller.law" in params:
        return
    for key in _foreign(params, {law}):
        raise _unused(f"trial value {key}={params[key]}", "", key, f"this trial runs the {law} law",
                      "the Tune experiment was started for the {law} law: run it again with controller.law={law}, or "
                      "start a new one under another run.name", "sweep {key} instead")
