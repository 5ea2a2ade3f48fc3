"""Convert checkpoints between HF safetensors and megatron-core dist checkpoints.

`mcore-rl convert ...` and `python -m tools.checkpoint_convert ...` (library: mcore_rl.conversion):

  mcore-rl convert hf-to-mcore SRC_HF_DIR DST_DIR [--dtype D] [--force] [--verify ...]
  mcore-rl convert mcore-to-hf SRC_DIR DST_HF_DIR [--hf-config DIR] [--max-shard-size 5GB] ...
  mcore-rl convert mcore-to-peft SRC_ACTOR_DIR DST_ADAPTER_DIR [--hf-config DIR] [--force]

Parallel: `--workers N` spawns N local ranks; under torchrun / srun every process is a rank
(e.g. `torchrun --nproc-per-node 8 -m tools.checkpoint_convert hf-to-mcore SRC DST`); each
converts a disjoint share of the tensors. The output appears only when complete — with
--verify only once verified too: it is written to a hidden directory beside DST, checked, and
renamed to DST; a failed check removes it and says so in one line. `mcore-to-hf` also reads a
run's checkpoint (`RUN_DIR/checkpoints/step_<k>/actor`; `mcore-rl export` finds it for you):
conversion and --verify read its model weights, never its optimizer.
Exit codes: 0 done (and verified, with --verify), 1 verification failed, 2 bad input or
refused output, 130 interrupted. The last line of stdout is a JSON summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

VERBS = ("hf-to-mcore", "mcore-to-hf", "mcore-to-peft")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="stored dtype (auto: keep each tensor's source dtype)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--workers", type=int, default=1,
                   help="local ranks to convert with (under torchrun/srun: the job's ranks)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    v = p.add_argument_group("verification (compares logits; loads both models whole)")
    v.add_argument("--verify", action="store_true",
                   help="after converting, compare HF transformers and Megatron logits; DST "
                        "appears only when they agree")
    v.add_argument("--verify-tp", type=int, default=1, help="Megatron TP for --verify")
    v.add_argument("--verify-pp", type=int, default=1, help="Megatron PP for --verify")
    v.add_argument("--verify-vpp", type=int, default=None, help="Megatron VPP for --verify")
    v.add_argument("--verify-ep", type=int, default=1,
                   help="Megatron expert parallel for --verify (mixture of experts; must "
                        "divide the experts; DP grows so that ep·etp divides tp·dp)")
    v.add_argument("--verify-etp", type=int, default=None,
                   help="Megatron expert-TP for --verify (default: --verify-tp)")
    v.add_argument("--verify-prompts", type=int, default=3)
    v.add_argument("--verify-seq-len", type=int, default=16)
    v.add_argument("--verify-atol", type=float, default=1e-3,
                   help="fail (exit 1) above this max |logit diff| (both sides run in fp32)")


def add_verbs(sub: argparse._SubParsersAction) -> None:
    h2m = sub.add_parser("hf-to-mcore", help="HF safetensors folder -> megatron dist checkpoint",
                         description="HF safetensors folder -> megatron-core dist checkpoint "
                                     "(loads at any TP/PP/VPP)")
    h2m.add_argument("src", type=Path, metavar="SRC_HF_DIR")
    h2m.add_argument("dst", type=Path, metavar="DST_DIR")
    _common(h2m)
    h2m.set_defaults(func=run, verb="hf-to-mcore")
    m2h = sub.add_parser("mcore-to-hf", help="megatron dist checkpoint -> HF safetensors folder",
                         description="megatron-core dist checkpoint (any grid) -> HF "
                                     "safetensors folder (transformers / vLLM). A LoRA run's "
                                     "actor checkpoint (actor.lora; it holds lora.json) gives "
                                     "the merged model: W + (alpha / rank)·B·A for every "
                                     "adapted weight.")
    m2h.add_argument("src", type=Path, metavar="SRC_DIR")
    m2h.add_argument("dst", type=Path, metavar="DST_HF_DIR")
    m2h.add_argument("--hf-config", type=Path, default=None,
                     help="folder with the model's config.json + tokenizer (default: "
                          "SRC_DIR/hf_config, written by hf-to-mcore; for a LoRA checkpoint "
                          "without it, the base recorded in SRC_DIR/lora.json)")
    m2h.add_argument("--max-shard-size", default="5GB",
                     help="cap per safetensors file, e.g. 5GB, 500MB, 2GiB")
    _common(m2h)
    m2h.set_defaults(func=run, verb="mcore-to-hf")
    m2p = sub.add_parser("mcore-to-peft", help="LoRA run checkpoint -> PEFT adapter folder",
                         description="the adapters of a LoRA run's actor checkpoint "
                                     "(actor.lora; any grid) -> a PEFT adapter folder "
                                     "(adapter_config.json + adapter_model.safetensors)")
    m2p.add_argument("src", type=Path, metavar="SRC_ACTOR_DIR",
                     help="a run checkpoint's actor/ folder (it holds lora.json)")
    m2p.add_argument("dst", type=Path, metavar="DST_ADAPTER_DIR")
    m2p.add_argument("--hf-config", type=Path, default=None,
                     help="folder with the base model's config.json (default: the base "
                          "recorded in SRC_ACTOR_DIR/lora.json)")
    m2p.add_argument("--force", action="store_true", help="replace DST if it exists")
    m2p.set_defaults(func=run_peft, verb="mcore-to-peft")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `mcore-rl convert` (mcore_rl/cli.py COMMANDS)."""
    convert = sub.add_parser("convert", help="checkpoint conversion HF <-> megatron-core",
                             description=__doc__.splitlines()[0])
    add_verbs(convert.add_subparsers(dest="verb", required=True, metavar="DIRECTION"))


def build_parser(prog: str = "python -m tools.checkpoint_convert") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_verbs(parser.add_subparsers(dest="verb", required=True, metavar="DIRECTION"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


# --- running -----------------------------------------------------------------------------------


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from mcore_rl.conversion.errors import ConversionError
    from mcore_rl.config import ConfigError
    from mcore_rl.layouts import LayoutError
    from mcore_rl.models.hf_weights import WeightsError
    from mcore_rl.models.spec import UnsupportedModelError

    return (ConversionError, ConfigError, LayoutError, WeightsError, UnsupportedModelError,
            FileNotFoundError)


def _error(args, err: BaseException, ranks=None) -> int:
    where = f" (rank {ranks.rank})" if ranks is not None and ranks.distributed else ""
    print(f"mcore-rl convert {args.verb}{where}: error: {err}", file=sys.stderr)
    return 2


def _large_allocations_unmapped(threshold: int = 1 << 20) -> None:
    """Make glibc serve every allocation >= 1 MiB with its own mapping, returned on free.

    By default glibc raises its mmap threshold to the largest block freed so far (up to
    32 MiB): after the first big tensor, mid-size tensors come from the heap, which fragments
    and does not shrink, and a conversion's RSS creeps up tensor after tensor. A converter
    allocates and frees one tensor at a time, so a fixed threshold keeps it at what is live.
    Process-wide: done here, for the CLI's own process, not in the library."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (fixed: stops the dynamic raise)
    except (OSError, AttributeError):
        pass                          # not glibc: nothing to tune


def run(args) -> int:
    from mcore_rl.conversion.ranks import current_ranks, leave

    _large_allocations_unmapped()
    if args.workers < 1:
        return _error(args, ValueError(f"--workers={args.workers}: must be >= 1"))
    if current_ranks().distributed:          # a caller's group: convert in it, leave it be
        return _convert_on_ranks(args, joined_here=False)
    try:
        return _convert_on_ranks(args, joined_here=True)
    finally:
        leave(wait_for_all=False)            # after an error; a no-op once left below


def run_peft(args) -> int:
    """`mcore-to-peft`: small (the adapters only), one process."""
    from mcore_rl.conversion.peft_adapter import mcore_to_peft

    try:
        dst = mcore_to_peft(args.src, args.dst, hf_config=args.hf_config, force=args.force)
    except _bad_input_errors() as err:
        return _error(args, err)
    print(json.dumps({"verb": args.verb, "src": str(args.src), "dst": str(dst)}))
    return 0


def _convert_on_ranks(args, joined_here: bool) -> int:
    """Join the job's ranks, convert this rank's share, leave the group together (if this
    command joined it), and report (first rank)."""
    from mcore_rl.conversion.ranks import RankFailed, Ranks, init_from_env, leave

    ranks = Ranks()
    try:
        ranks = init_from_env()
        if ranks.distributed and args.workers > 1:
            return _error(args, ValueError("--workers with torchrun/srun: the job's ranks "
                                           "already convert in parallel"))
        grid = _verify_grid(args)            # refuse an impossible grid before converting
        # with --verify, converted into a hidden directory beside DST; renamed to DST once
        # verified (`_verify_then_commit`): an unverified output never appears at DST
        staged = _staged_output(args, ranks) if grid is not None else None
        kwargs = _kwargs(args, staged)
        if args.workers > 1:
            report = _spawn(args, kwargs)
        else:
            report = _convert(args.verb, kwargs, ranks=ranks)
    except KeyboardInterrupt:
        print(f"mcore-rl convert {args.verb}: interrupted; nothing written at {args.dst}",
              file=sys.stderr)
        return 130
    except _bad_input_errors() as err:
        return _error(args, err, ranks)
    except RankFailed as err:                # the failing rank printed its own error
        if ranks.is_first:
            _error(args, err, ranks)
        return 2
    if joined_here:
        leave(wait_for_all=True)             # every rank converted; the check spawns its own
    if not ranks.is_first:
        return 0
    report = dataclasses.replace(report, dst=str(args.dst.absolute()))
    print(report.summary())
    summary = report.as_dict()
    code = 0
    if grid is not None:
        code, summary["verify"] = _verify_then_commit(args, grid, staged)
    print(json.dumps(summary))
    return code


def _staged_output(args, ranks) -> Path:
    """Where a conversion to be verified is written: a fresh hidden directory beside DST
    (rank 0 names it). DST itself is checked first (exists without --force, ...)."""
    from mcore_rl.conversion import output

    output.check_paths(args.src.absolute(), args.dst.absolute(), force=args.force)
    return ranks.broadcast(output.temp_dir_for(args.dst) if ranks.is_first else None)


def _verify_then_commit(args, grid, staged: Path) -> tuple[int, dict]:
    """Verify the conversion written to `staged`; rename it to DST only when verified. On a
    failed or broken verification (or Ctrl-C) it is removed, one line says why, and DST is
    left as it was: exit 1 (130 interrupted)."""
    from mcore_rl.conversion import output

    where = f"nothing written at {args.dst}"
    try:
        code, verified = _run_verify(args, grid, staged)
        if code == 0:
            output.commit(staged, args.dst.absolute(), force=args.force)
        else:
            print(f"mcore-rl convert {args.verb}: verification FAILED: max |logit diff| "
                  f"{verified['max_abs_diff']:.3e} > --verify-atol {args.verify_atol:g}; "
                  f"{where}", file=sys.stderr)
        return code, verified
    except KeyboardInterrupt:
        print(f"mcore-rl convert {args.verb}: interrupted while verifying; {where}",
              file=sys.stderr)
        return 130, {"ok": False, "error": "interrupted"}
    except Exception as err:  # the check itself broke (a rank failed, ...): no verified output
        lines = str(err).strip().splitlines() or [type(err).__name__]
        print(f"mcore-rl convert {args.verb}: verification could not run: {lines[-1]}; "
              f"{where}", file=sys.stderr)
        return 1, {"ok": False, "error": lines[-1]}
    finally:
        output.remove(staged)  # gone after the commit; the unverified output otherwise


def _kwargs(args, dst: Path | None = None) -> dict:
    """The conversion's arguments; `dst`: where it writes (default DST)."""
    from mcore_rl.conversion.safetensors_io import parse_size

    kwargs = dict(src=args.src, dst=dst or args.dst, dtype=_dtype(args), force=args.force,
                  progress=not args.no_progress)
    if args.verb == "mcore-to-hf":
        try:
            kwargs.update(hf_config=args.hf_config,
                          max_shard_bytes=parse_size(args.max_shard_size))
        except ValueError as err:
            from mcore_rl.conversion.errors import ConversionError

            raise ConversionError(f"--max-shard-size: {err}") from None
    return kwargs


def _convert(verb: str, kwargs: dict, **extra):
    from mcore_rl.conversion.convert import hf_to_mcore, mcore_to_hf

    return (hf_to_mcore if verb == "hf-to-mcore" else mcore_to_hf)(**kwargs, **extra)


def _convert_rank(rank: int, world: int, verb: str, kwargs: dict, tmp: Path):
    from mcore_rl.conversion.ranks import current_ranks

    _large_allocations_unmapped()
    kwargs = dict(kwargs, progress=kwargs["progress"] and rank == 0)
    return _convert(verb, kwargs, ranks=current_ranks(), tmp_dir=tmp)


def _spawn(args, kwargs: dict):
    """`--workers N`: N spawned gloo ranks; the temp dir is chosen here so it is removed even
    if the ranks are killed."""
    from mcore_rl.conversion import output
    from mcore_rl.launch.spawn import DistributedRunError, run_on_ranks

    output.check_paths(args.src.absolute(), args.dst.absolute(), force=args.force)
    tmp = output.temp_dir_for(args.dst)
    try:
        return run_on_ranks(_convert_rank, args.workers, args.verb, kwargs, tmp,
                            timeout_s=24 * 3600)[0]
    except DistributedRunError as err:
        from mcore_rl.conversion.errors import ConversionError

        first = str(err).strip().splitlines()[-1]
        raise ConversionError(f"a worker failed: {first}") from None
    finally:
        output.remove(tmp)  # gone after a successful commit; a leftover after a failure


def _spec_for(args):
    from mcore_rl.conversion.convert import model_config_dir
    from mcore_rl.conversion.hf_source import read_spec

    if args.verb == "hf-to-mcore":
        return read_spec(args.src)
    return read_spec(model_config_dir(args.src.absolute(), args.hf_config))


def _refuse_verify_of_lora(args) -> None:
    """--verify runs the checkpoint's Megatron model without adapters: against a merged LoRA
    model it would report the adapters as a conversion error."""
    from mcore_rl.conversion.convert import open_checkpoint
    from mcore_rl.conversion.errors import ConversionError
    from mcore_rl.conversion.lora_checkpoint import lora_meta_of

    src = args.src.absolute()
    if args.verb == "mcore-to-hf" and lora_meta_of(src, open_checkpoint(src)) is not None:
        raise ConversionError(f"{src}: a LoRA checkpoint; --verify runs its Megatron model "
                              "without the adapters, so it cannot check the merged model: "
                              "convert without --verify")


def _verify_grid(args):
    """The verification grid, checked against the model (TP must divide heads, PP·VPP the
    layers, EP the experts), or None without --verify."""
    if not args.verify:
        return None
    _refuse_verify_of_lora(args)
    import math

    from mcore_rl.config import ConfigError
    from mcore_rl.layouts import validate_megatron_grid
    from mcore_rl.parallel.config import ParallelConfig

    etp = args.verify_etp or args.verify_tp
    # The expert grid lies over the dense tp·dp ranks of a stage: the smallest DP that fits it.
    dp = math.lcm(args.verify_tp, max(etp * args.verify_ep, 1)) // max(args.verify_tp, 1)
    grid = ParallelConfig(tp=args.verify_tp, pp=args.verify_pp, vpp=args.verify_vpp,
                          dp=max(dp, 1), ep=args.verify_ep, etp=args.verify_etp)
    spec = _spec_for(args)
    try:
        grid.check_model(spec)
    except ConfigError as err:  # named as the user spelled it: --verify-tp=3, not parallel.tp
        raise ConfigError(f"--verify-{err.field.replace('_', '-')}", err.value,
                          err.problem) from None
    validate_megatron_grid(spec, grid)
    return spec, grid


def _dtype(args):
    """--dtype as a torch dtype; None for auto (keep each tensor's source dtype)."""
    from mcore_rl.config.dtypes import torch_dtype

    return None if args.dtype == "auto" else torch_dtype(args.dtype)


def _run_verify(args, grid, converted: Path) -> tuple[int, dict]:
    """Logits of the source against those of `converted` (the conversion's output): the
    model weights only — a run checkpoint's optimizer is not loaded."""
    from mcore_rl.conversion.verify import verify_conversion

    spec, parallel = grid
    hf_dir, ckpt = ((args.src, converted) if args.verb == "hf-to-mcore"
                    else (converted, args.src))
    # With --dtype the result holds rounded weights: round the source the same way.
    report = verify_conversion(hf_dir, ckpt, spec, parallel,
                               weights_dtype=_dtype(args),
                               prompts=args.verify_prompts, seq_len=args.verify_seq_len)
    print(report.summary())
    ok = report.max_abs_diff <= args.verify_atol
    return (0 if ok else 1), {"max_abs_diff": report.max_abs_diff, "grid": report.grid,
                              "ok": ok}
