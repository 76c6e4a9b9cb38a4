"""LoRA adapters on a base model for scoring and generation: where an adapter lives (:func:`adapter_dir`, local or
remote), loading one with a check that it fits (:func:`attach_adapters`), and scoring many one after another
(:class:`AdapterSlots`).

Many adapters are not held side by side. peft's ``load_adapter`` walks every module of the model, adapters included,
so each load is slower than the last: attaching 41 adapters of SmolLM2-135M at r 16 costs about a minute of host time
(62 s measured on an H200 machine), as much as scoring them all. :class:`AdapterSlots` keeps one peft adapter per
distinct ``adapter_config.json`` and copies a later adapter's weights into it, so the n-th adapter costs what the
first did.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from raytrain_scu.config.io import redact_uri
from raytrain_scu.config.paths import is_remote
from raytrain_scu.core import storage
from raytrain_scu.errors import EvalError


def adapter_dir(path: str) -> str:
    """A peft adapter directory: ``path`` itself, or its ``adapter/`` (a training checkpoint). Raises EvalError. A
    remote URI (``s3://...``, its filesystem options as a query) is checked there and kept: each scoring process
    downloads it (:func:`local_adapter`)."""
    if is_remote(path):
        for candidate in (path, storage.join(path, "adapter")):
            if storage.is_file(storage.join(candidate, "adapter_config.json")):
                return candidate
        raise EvalError(f"{redact_uri(path)} is not a peft adapter: no adapter_config.json in it or in its adapter/")
    p = Path(os.path.expanduser(path))
    if not p.is_dir():
        raise EvalError(f"adapter directory not found: {p}")
    for candidate in (p, p / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            return str(candidate)
    raise EvalError(f"{p} is not a peft adapter: no adapter_config.json in it or in {p / 'adapter'}")


def local_adapter(path: str, stack: contextlib.ExitStack) -> str:
    """``path`` itself when local; a remote adapter downloaded to a directory that lives as long as ``stack``."""
    if not is_remote(path):
        return path
    local = stack.enter_context(tempfile.TemporaryDirectory(prefix="raytrain_scu_adapter_"))
    return str(storage.download_dir(path, local))


def _misfit(path: str, placed: set, saved: set) -> None:
    """EvalError when the saved weights and the ones the model holds for the adapter are not the same set (peft
    silently drops saved weights with no module, and leaves target modules the file does not cover at their no-op
    init)."""
    unplaced, uncovered = sorted(saved - placed), sorted(placed - saved)
    problems = []
    if unplaced:
        problems.append(f"{len(unplaced)} of its {len(saved)} weights have no place in the model, e.g. {unplaced[0]}")
    if uncovered:
        problems.append(f"{len(uncovered)} weights the model expects are not in it, e.g. {uncovered[0]}")
    if problems:
        raise EvalError(f"adapter {path} does not fit this base model (made for another one?): " + "; ".join(problems))


def _doesnt_fit(path: str, e: Exception) -> EvalError:
    return EvalError(f"adapter {path} does not fit this base model (made for another one?): "
                     f"{type(e).__name__}: {str(e)[:400]}")


def attach_adapters(model, adapters: dict[str, str]):
    """``model`` (a base model, or a PeftModel already) with each non-empty ``{label: adapter_dir}`` loaded as a peft
    adapter named ``label``; returns the PeftModel. An adapter made for another base model is an EvalError: peft
    raises on mismatched shapes, and :func:`_misfit` checks the weights' set."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    for label, path in adapters.items():
        if not path:
            continue
        try:
            if isinstance(model, PeftModel):
                model.load_adapter(path, adapter_name=label)
            else:
                model = PeftModel.from_pretrained(model, path, adapter_name=label)
        except (RuntimeError, ValueError, KeyError) as e:
            raise _doesnt_fit(path, e) from None
        _misfit(path, set(get_peft_model_state_dict(model, adapter_name=label)),
                set(load_peft_weights(path, device="cpu")))
    return model


def _config_key(path: str) -> str:
    return json.dumps(json.loads((Path(path) / "adapter_config.json").read_text()), sort_keys=True)


class AdapterSlots:
    """One base model scored under many adapters in turn. Adapters with the same ``adapter_config.json`` share one
    peft adapter (a slot), loaded here from the first of them; :meth:`use` copies an adapter's weights into its slot
    and makes it the active one. ``model`` is final once this is built (a PeftModel when any path is given), so a
    loss module can wrap it."""

    def __init__(self, base, paths):
        from peft.utils import get_peft_model_state_dict

        self.model = base
        self.slots: dict[str, tuple[str, set]] = {}  # config json -> (slot name, the weight keys it holds)
        for path in paths:
            if path and _config_key(path) not in self.slots:
                name = f"slot{len(self.slots)}"
                self.model = attach_adapters(self.model, {name: path})
                self.slots[_config_key(path)] = (name, set(get_peft_model_state_dict(self.model, adapter_name=name)))

    def _load(self, path: str) -> None:
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        name, placed = self.slots[_config_key(path)]
        saved = load_peft_weights(path, device="cpu")
        _misfit(path, placed, set(saved))
        try:
            set_peft_model_state_dict(self.model, saved, adapter_name=name)
        except (RuntimeError, ValueError, KeyError) as e:
            raise _doesnt_fit(path, e) from None
        self.model.set_adapter(name)

    @contextlib.contextmanager
    def use(self, path: str):
        """Score with the adapter at ``path`` (one of the paths given) active, or with the bare base when ``path`` is
        empty."""
        from peft import PeftModel

        if path:
            self._load(path)
            yield
        elif isinstance(self.model, PeftModel):
            with self.model.disable_adapter():
                yield
        else:
            yield
