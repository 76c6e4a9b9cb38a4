"""The sweep's search space, with no Ray: what is swept (:func:`resolve_space`, checked before launch), how a trial's
values become its config (:func:`apply_params`, :func:`trial_config`), and the bounds of the trials' batches.

The two batch knobs are kept apart (``sweep.py`` says how): a swept ``global_batch_tokens`` sets data.grad_accum; with
``tune.keep_tokens_per_step`` a swept data.batch_size keeps the base's tokens per optimizer step.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict

from raytrain_scu.config.io import get_dotted, set_dotted
from raytrain_scu.config.law_keys import check_space_laws, check_trial_law
from raytrain_scu.config.load import build_config
from raytrain_scu.config.paths import run_dir
from raytrain_scu.config.schema import ARM, GLOBAL_BATCH, Config, global_batch_tokens
from raytrain_scu.errors import ConfigError, SweepError
from raytrain_scu.tracking.store import tracking_uri

THROUGHPUT_PREFIX = "perf/"  # metrics that score speed, not the loss (the loop reports perf/tokens_per_s)


def _around_default(key: str) -> dict:
    """Log-uniform from a quarter to four times the config's default of ``key`` (``controller.<name>``)."""
    d = getattr(Config().controller, key.removeprefix("controller."))
    return {"loguniform": [d / 4, d * 4]}


# the default space's ranges of each law's two gains: logodds' 4x either side of each default; the spec's kp 4x
# either side, its ki 0.02-0.6 (not centred on its 0.15)
LAW_GAINS = {
    "logodds": {k: _around_default(k) for k in ("controller.logodds_kp", "controller.logodds_ki")},
    "spec": {"controller.kp": _around_default("controller.kp"), "controller.ki": {"loguniform": [0.02, 0.6]}},
}


def default_space(cfg: Config) -> dict:
    """What is swept when ``tune.space`` is empty, by what the sweep scores.

    On a throughput metric (``perf/...``): the micro-batch (data.batch_size), half, same and double the config's. On
    a loss: the global batch (``global_batch_tokens``: half, same and double the config's, those a whole
    data.grad_accum reaches at the config's micro-batch), or with ``tune.keep_tokens_per_step=false`` the micro-batch,
    which then moves the global batch; and under controller.mode=scu the target and the two gains of the config's
    controller.law (``LAW_GAINS``: logodds_kp and logodds_ki, or the spec's kp and ki).
    """
    b, per_step = cfg.data.batch_size, cfg.data.batch_size * cfg.data.grad_accum
    batches = sorted({x for x in (b // 2, b, 2 * b) if x >= 1})
    if cfg.tune.keep_tokens_per_step:  # only batches that keep the tokens per optimizer step
        batches = [x for x in batches if per_step % x == 0]
    if cfg.tune.metric.startswith(THROUGHPUT_PREFIX):
        return {"data.batch_size": {"choice": batches}}
    if cfg.tune.keep_tokens_per_step:
        g = global_batch_tokens(cfg)
        micro = g // cfg.data.grad_accum  # tokens of one micro-step over all workers
        space = {GLOBAL_BATCH: {"choice": [x for x in (g // 2, g, 2 * g) if x >= micro and x % micro == 0]}}
    else:
        space = {"data.batch_size": {"choice": batches}}
    if cfg.controller.mode == "scu":
        space.update(LAW_GAINS[cfg.controller.law])
        space["controller.target_s"] = {"loguniform": [0.002, 0.05]}
    return space


def plain_value(value):
    """A sampled value as a plain Python one (Tune's samplers give numpy scalars)."""
    return value.item() if hasattr(value, "item") else value


def flat_params(params: dict) -> dict:
    """A trial's values with an ``arm`` bundle spread into its config keys (a key set both ways: the arm's wins)."""
    if ARM not in params:
        return params
    return {**{k: v for k, v in params.items() if k != ARM}, **params[ARM]}


def arm_text(arm: dict) -> str:
    """An arm as table text: ``controller.mode=fixed controller.lambda_init=0.1``."""
    return " ".join(f"{k}={plain_value(v)}" for k, v in arm.items())


def apply_params(base: Config, params: dict) -> Config:
    """The base config with one trial's values set (and validated).

    A swept ``global_batch_tokens`` (tokens per optimizer step over all workers) sets data.grad_accum to
    global_batch_tokens / (data.batch_size x scaling.num_workers x data.block_size), the trial's micro-batch and block
    size; one that is not a whole number of micro-steps is a ConfigError. Otherwise, with
    ``tune.keep_tokens_per_step`` a swept data.batch_size sets data.grad_accum to
    base batch_size x base grad_accum / batch_size; a batch that does not divide that product is a ConfigError.
    """
    tree = asdict(base)
    params = flat_params(params)
    for key, value in params.items():
        if key != GLOBAL_BATCH:
            set_dotted(tree, key, plain_value(value))
    if GLOBAL_BATCH in params:
        tokens, d = plain_value(params[GLOBAL_BATCH]), tree["data"]
        if isinstance(tokens, float) and tokens.is_integer():
            tokens = int(tokens)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise ConfigError(f"{GLOBAL_BATCH}: expected a positive int (tokens per optimizer step), got {tokens!r}")
        micro = d["batch_size"] * tree["scaling"]["num_workers"] * d["block_size"]
        if isinstance(micro, int) and micro >= 1:  # anything else: build_config names the bad key
            if tokens < micro or tokens % micro:
                raise ConfigError(f"{GLOBAL_BATCH}={tokens} is not a whole number of micro-steps of "
                                  f"data.batch_size={d['batch_size']} x scaling.num_workers="
                                  f"{tree['scaling']['num_workers']} x data.block_size={d['block_size']} = {micro} "
                                  f"tokens: pick global batches that are multiples of {micro}")
            d["grad_accum"] = tokens // micro
    elif base.tune.keep_tokens_per_step and "data.batch_size" in params:
        per_step = base.data.batch_size * base.data.grad_accum
        batch = tree["data"]["batch_size"]
        if isinstance(batch, int) and batch >= 1:  # anything else: build_config names the problem
            if per_step % batch:
                raise ConfigError(f"data.batch_size={batch} does not divide the base config's {per_step} sequences "
                                  f"per worker per optimizer step (data.batch_size x data.grad_accum): with "
                                  f"tune.keep_tokens_per_step=true every swept batch must divide it (or set "
                                  f"tune.keep_tokens_per_step=false)")
            tree["data"]["grad_accum"] = per_step // batch
    return build_config(tree, default_name=base.run.name)


def resolve_space(cfg: Config, *, with_lr: bool = False) -> dict:
    """The space to sweep, checked against the search, the scheduler and the config. Raises SweepError.

    Each entry's form was checked when the config was built (``config.validate_space_entry``); here every listed
    value, and both ends of every range, must make a valid config; listed values get their key's type.
    """
    t = cfg.tune
    space = dict(t.space) or default_space(cfg)
    if with_lr and "optim.lr" not in space:
        space["optim.lr"] = {"loguniform": [float(f"{cfg.optim.lr / 10:.3g}"), float(f"{cfg.optim.lr * 10:.3g}")]}
    if not space:
        raise SweepError("tune.space is empty: nothing to sweep")
    scaling = [k for k in space if k.startswith("scaling.")]
    if scaling:
        # one trial's resources size the concurrency and are checked against the cluster once, from the base config
        raise SweepError(f"tune.space cannot sweep {', '.join(scaling)}: every trial takes the base config's "
                         f"scaling.* (set them as overrides, one sweep per setting)")
    kinds = {key: next(iter(spec)) for key, spec in space.items()}
    if ARM in space:
        _check_arms(space, kinds[ARM])
    try:  # here too: a study sets its stage's space on a config already resolved
        check_space_laws(cfg.controller.law, space)
    except ConfigError as e:
        raise SweepError(str(e)) from None
    _check_search(t.search, kinds)
    _check_batch_keys(cfg, space, kinds)
    if t.metric == "perf/tokens_per_s" and t.mode != "max":
        raise SweepError("tune.metric=perf/tokens_per_s is better when higher: set tune.mode=max")
    if t.scheduler == "asha" and t.grace_period * cfg.train.report_every > cfg.train.max_steps:
        raise SweepError(f"tune.grace_period={t.grace_period} reports x train.report_every={cfg.train.report_every} "
                         f"is beyond train.max_steps={cfg.train.max_steps}: ASHA could never stop a trial")
    return _typed_space(cfg, space)


ARM_REFUSED = ("data.batch_size", "data.grad_accum", "data.block_size")  # the batch keys the space's bounds read


def _check_arms(space: dict, kind: str) -> None:
    """An arm lists bundles, sets no key the space also sweeps (which would win silently), and no batch key (the
    memory fit, ASHA's time axis and the tokens-per-step checks read the batch from the space's keys)."""
    if kind not in ("choice", "grid"):
        raise SweepError(f"tune.space.{ARM} lists bundles of values: give it as grid or choice")
    for i, arm in enumerate(space[ARM][kind]):
        clash = sorted(k for k in arm if k in space or k in ARM_REFUSED)
        if clash:
            raise SweepError(f"tune.space.{ARM}[{i}] sets {', '.join(clash)}: sweep "
                             f"{'it' if len(clash) == 1 else 'them'} as its own tune.space key"
                             f"{'' if set(clash) - set(ARM_REFUSED) else ' (an arm sets no batch key)'}, not in an arm")


def _check_search(search: str, kinds: dict) -> None:
    """The space's kinds against ``tune.search``: grid takes listed values only, optuna no grid (and needs optuna)."""
    ranges = [k for k, kind in kinds.items() if kind not in ("choice", "grid")]
    grids = [k for k, kind in kinds.items() if kind == "grid"]
    if search == "grid" and ranges:
        raise SweepError(f"tune.search=grid runs every combination of listed values, but {', '.join(ranges)} "
                         f"{'is a range' if len(ranges) == 1 else 'are ranges'}: give choice/grid values in "
                         f"tune.space, or use tune.search=random or optuna")
    if search == "optuna":
        if grids:
            raise SweepError(f"tune.search=optuna picks values itself: use choice instead of grid for "
                             f"{', '.join(grids)}")
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise SweepError("tune.search=optuna needs optuna, an extra: pip install 'raytrain_scu[optuna]' "
                             "(or use tune.search=random)") from None


def _check_batch_keys(cfg: Config, space: dict, kinds: dict) -> None:
    """The batch keys against ``tune.keep_tokens_per_step``: the micro-batch is scored on speed, data.grad_accum is
    derived, and every swept global batch is a whole number of micro-steps."""
    t = cfg.tune
    if t.keep_tokens_per_step:
        if "data.grad_accum" in space:
            raise SweepError(f"tune.keep_tokens_per_step=true sets data.grad_accum from data.batch_size (or "
                             f"{GLOBAL_BATCH}): remove data.grad_accum from tune.space (sweep the global batch with "
                             f"{GLOBAL_BATCH}), or set tune.keep_tokens_per_step=false")
        if kinds.get("data.batch_size") not in (None, "choice", "grid"):
            raise SweepError("tune.keep_tokens_per_step=true needs data.batch_size as choice or grid values (each "
                             "must divide the base batch_size x grad_accum), not a range")
        if "data.batch_size" in space and not t.metric.startswith(THROUGHPUT_PREFIX):
            # the micro-batch only regroups the same sequences of each step: the loss moves by float noise
            raise SweepError(f"data.batch_size is the micro-batch, a throughput and memory knob: with "
                             f"tune.keep_tokens_per_step=true every trial takes the same tokens per optimizer step "
                             f"whatever its micro-batch, so {t.metric} differs between them only by float noise and "
                             f"the sweep would select noise. Tune the micro-batch on speed (tune.metric="
                             f"perf/tokens_per_s tune.mode=max, data.batch_size alone in tune.space) or let the memory "
                             f"estimate fit it (docs/sweep.md); tune the global batch with {GLOBAL_BATCH} in "
                             f"tune.space")
    if GLOBAL_BATCH in space:
        if not t.keep_tokens_per_step:
            raise SweepError(f"tune.space.{GLOBAL_BATCH} sets each trial's tokens per step and derives data.grad_accum "
                             f"from it, but tune.keep_tokens_per_step=false keeps data.grad_accum: set "
                             f"tune.keep_tokens_per_step=true")
        linked = [k for k in (GLOBAL_BATCH, "data.batch_size", "data.block_size") if k in space]
        if any(kinds[k] not in ("choice", "grid") for k in linked):
            raise SweepError(f"{GLOBAL_BATCH} / (data.batch_size x scaling.num_workers x data.block_size) is a trial's "
                             f"data.grad_accum and must be whole: give {', '.join(linked)} as choice or grid values, "
                             f"not ranges")
        for combo in itertools.product(*(next(iter(space[k].values())) for k in linked)):
            try:
                apply_params(cfg, dict(zip(linked, combo)))
            except ConfigError as e:
                raise SweepError(f"tune.space {', '.join(f'{k}={v}' for k, v in zip(linked, combo))}: {e}") from None


def _typed_space(cfg: Config, space: dict) -> dict:
    """The space with every listed value checked on a trial config and given its key's type (ranges as given)."""
    typed = {}
    for key, spec in space.items():
        (kind, args), = spec.items()
        values = []
        for v in args:
            try:
                trial = apply_params(cfg, {key: v})
                values.append(dict(v) if key == ARM else space_value(trial, key))
            except ConfigError as e:
                raise SweepError(f"tune.space.{key} value {v!r}: {e}") from None
        typed[key] = {kind: values if kind in ("choice", "grid") else list(args)}
    return typed


def space_value(cfg: Config, key: str):
    """A trial config's value of a space key: a config key's value, the global batch in tokens, or (an arm: no one
    value) None."""
    if key == ARM:
        return None
    return global_batch_tokens(cfg) if key == GLOBAL_BATCH else get_dotted(cfg, key)


def _bounds(cfg: Config, space: dict, key: str) -> tuple:
    """(lowest, highest) value a trial can take for ``key``: the listed values' or the range's ends, or the base's."""
    spec = space.get(key)
    if not spec:
        value = space_value(cfg, key)
        return value, value
    values = next(iter(spec.values()))
    return min(values), max(values)


def tokens_per_step_bounds(cfg: Config, space: dict) -> tuple[int, int]:
    """(smallest, largest) tokens per optimizer step any trial takes (scaling.* is never swept)."""
    if GLOBAL_BATCH in space:
        lo, hi = _bounds(cfg, space, GLOBAL_BATCH)
        return int(lo), int(hi)
    block = _bounds(cfg, space, "data.block_size")
    if cfg.tune.keep_tokens_per_step:  # the base's sequences per step, whatever the micro-batch
        seqs = (cfg.data.batch_size * cfg.data.grad_accum,) * 2
    else:
        batch, accum = _bounds(cfg, space, "data.batch_size"), _bounds(cfg, space, "data.grad_accum")
        seqs = (batch[0] * accum[0], batch[1] * accum[1])
    workers = cfg.scaling.num_workers
    return int(seqs[0] * workers * block[0]), int(seqs[1] * workers * block[1])


def max_sequences_per_step(cfg: Config, space: dict) -> int:
    """The largest global batch (sequences per optimizer step) any trial can take."""
    if GLOBAL_BATCH in space:
        return tokens_per_step_bounds(cfg, space)[1] // int(_bounds(cfg, space, "data.block_size")[0])
    if cfg.tune.keep_tokens_per_step:
        per_worker = cfg.data.batch_size * cfg.data.grad_accum
    else:
        per_worker = _bounds(cfg, space, "data.batch_size")[1] * _bounds(cfg, space, "data.grad_accum")[1]
    return int(per_worker * cfg.scaling.num_workers)  # scaling.* is never swept


def trial_config(base: Config, params: dict, trial_id: str) -> Config:
    """A trial's full config: its values, its own Train run under the sweep's directory (``config.run_dir`` of the
    sweep's config: the Tune experiment and the sweep's outputs live there too), the sweep's MLflow store."""
    cfg = apply_params(base, params)
    check_trial_law(cfg.controller.law, flat_params(params))
    cfg.run.name = f"{base.run.name}-{trial_id}"
    cfg.run.storage_path = f"{run_dir(base)}/trials"
    # the store and experiment are the sweep's, not derived from the trial's own storage path and name
    cfg.tracking.uri = tracking_uri(base)
    cfg.tracking.experiment = base.tracking.experiment or base.run.name
    return cfg
