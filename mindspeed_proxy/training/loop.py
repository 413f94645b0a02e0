"""The example trainer's main loop: validate, set up megatron-core, train, log, checkpoint, resume."""
from __future__ import annotations

import json
import os
import time
import warnings
from datetime import datetime

import torch

from mindspeed_proxy.cli import error
from mindspeed_proxy.cli import fail as _fail
from mindspeed_proxy.training import arguments as A


def _active_monitor():
    from mindspeed_proxy.patches.runtime import RUNTIME

    return RUNTIME.monitor


def resolve_log_dir(args) -> str:
    """--log-dir, else `<--save>/logs`, else ./runs/<timestamp>."""
    if args.log_dir:
        return args.log_dir
    if args.save:
        return os.path.join(args.save, "logs")
    return os.path.join("runs", datetime.now().strftime("%Y%m%d-%H%M%S"))


class MetricsWriter:
    """metrics.jsonl on global rank 0: resolved arguments and numerics settings (threads, ISA), then one per step."""

    def __init__(self, log_dir: str, args, enabled: bool):
        self.enabled = enabled
        self.path = os.path.join(log_dir, "metrics.jsonl")
        if enabled:
            os.makedirs(log_dir, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")
            from mindspeed_proxy.determinism import numerics_record

            self.write({"type": "args", "args": {k: _jsonable(v) for k, v in sorted(vars(args).items())},
                        "numerics": numerics_record()})

    def write(self, record: dict) -> None:
        """Append one JSON record (rank 0 only) and flush."""
        if self.enabled:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()

    def close(self) -> None:
        """Close the file."""
        if self.enabled:
            self._fh.close()


def _jsonable(value):
    return value if isinstance(value, (int, float, str, bool, type(None), list)) else str(value)


# What init_distributed started in this process (process-wide, like the groups themselves; kept out of args,
# which are saved with every checkpoint): finish_distributed ends exactly that.
_STARTED = {"process_group": False, "parallel_state": False}


def init_distributed(args) -> None:
    """Activate the platform, start the process group, check the world and initialise parallel_state.

    Records whether this call started the group / the model-parallel groups (`finish_distributed` then ends
    them); an existing parallel_state of the same layout is reused, one of another layout refused (ArgumentError)."""
    from mindspeed_proxy import parallel, platform

    _STARTED["process_group"] = not torch.distributed.is_initialized()
    platform.activate(args.device)
    if platform.current() == "cpu":
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "0")) or
                                  max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1")))))
    if not torch.distributed.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        # one process without a rendezvous address: an in-process store, no port to race other processes for
        store = torch.distributed.HashStore() if world == 1 and "MASTER_PORT" not in os.environ else None
        torch.distributed.init_process_group(platform.distributed_backend(), store=store,
                                             rank=int(os.environ.get("RANK", "0")), world_size=world)
    A.validate_world(args, torch.distributed.get_world_size())
    try:
        state = parallel.setup(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                               ep=args.expert_model_parallel_size, vpp=args.virtual_pipeline_model_parallel_size,
                               seed=args.seed)
    except parallel.ParallelSetupError as exc:
        raise A.ArgumentError(str(exc)) from None
    _STARTED["parallel_state"] = state.owned


def finish_distributed() -> None:
    """End the model-parallel groups and the process group `init_distributed` started: all ranks meet first, then
    they go (a gloo rank whose peer has already exited can abort at interpreter exit with "terminate called without
    an active exception")."""
    if _STARTED["parallel_state"]:
        from megatron.core import parallel_state as ps

        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        ps.destroy_model_parallel()
        _STARTED["parallel_state"] = False
    if _STARTED["process_group"] and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    _STARTED["process_group"] = False


def _print_rank0(message: str) -> None:
    if torch.distributed.get_rank() == 0:
        print(message, flush=True)


def _format_step(iteration: int, total: int, consumed: int, ms: float, result: dict, gbs: int,
                 skipped: int) -> str:
    grad = result["grad_norm"]
    return (f" iteration {iteration:8d}/{total:8d} | consumed samples: {consumed:12d} | "
            f"elapsed time per iteration (ms): {ms:.1f} | learning rate: {result['lr']:.6E} | "
            f"global batch size: {gbs:5d} | lm loss: {result['loss']:.6E} | "
            f"grad norm: {grad if grad is None else f'{grad:.3f}'} | "
            f"number of skipped iterations: {skipped:3d} |")


def stop_nonfinite(prog: str, step: int, args) -> None:
    """Stop the run with one line naming the step whose loss or gradient was not finite (exit code 1)."""
    if torch.distributed.get_rank() == 0:
        error(prog, f"iteration {step}: NaN or inf in the loss or the gradients; the step was not applied "
              "and the run stops (--no-check-for-nan-in-loss-and-grad skips and counts such steps)")
    finish_distributed()
    raise SystemExit(1)


def train(argv: list[str] | None = None, prog: str = "train_moe.py") -> int:
    """Run the trainer with Megatron-LM style `argv`; returns 0, exits 2 on bad input before writing."""
    # megatron-core announces each missing optional kernel package at import; on CPU that is expected
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
    parser = A.build_parser(prog)
    args = parser.parse_args(argv)
    from mindspeed_proxy.training import checkpointing as C
    from mindspeed_proxy.training import writers as W
    from mindspeed_proxy.training.engine import Trainer, microbatch_sample_ids
    from mindspeed_proxy.monitor.state import KEY as MONITOR_KEY, MonitorPart

    try:
        A.check_finite(parser, args)
        A.validate_static(args)
        if args.data_path:
            from mindspeed_proxy import data  # imports megatron-core: after the flags are checked

            data.validate_data_prefix(args.data_path)
        W.check_available(args.tensorboard_dir)
        load_format = C.checkpoint_format(args.load, args.ckpt_step) if args.load else None
        monitor_config = None
        if args.inject_fault:
            from mindspeed_proxy.faults.spec import RL_ONLY, parse_fault

            for text in args.inject_fault:
                if parse_fault(text).name in RL_ONLY:
                    raise ValueError(f"--inject-fault {text}: an RL fault; run it with python -m mindspeed_proxy.rl.train")
        if args.enable_mechanism_monitor:
            from mindspeed_proxy.monitor.arguments import default_output_dir, monitor_config_from_args

            monitor_config = monitor_config_from_args(args, default_output_dir(resolve_log_dir(args)))
    except ValueError as exc:
        _fail(prog, str(exc))
    try:
        init_distributed(args)
    except A.ArgumentError as exc:
        _fail(prog, str(exc))
    rank0 = torch.distributed.get_rank() == 0
    from mindspeed_proxy import data

    prefix = args.data_path or data.default_corpus_prefix(args.data_cache_path)
    train_ds, _ = data.build_gpt_datasets(prefix, args.seq_length, args.seed,
                                          args.train_iters * args.global_batch_size,
                                          cache_dir=args.data_cache_path)
    if monitor_config is not None or args.inject_fault:
        from mindspeed_proxy import patches
        from mindspeed_proxy.patches.runtime import RUNTIME

        RUNTIME.iteration = 0 if not args.load or args.finetune else \
            args.ckpt_step if args.ckpt_step is not None else C.read_tracker(args.load)
        RUNTIME.resume = bool(args.load) and not args.finetune  # the monitor's folder continues that run
        patches.apply(monitor_config, enable_monitor=monitor_config is not None, faults=args.inject_fault)
    writer = W.build_writer(args.tensorboard_dir, torch.distributed.get_rank() ==
                            (monitor_config.log_rank if monitor_config is not None else 0))
    if writer is not None:
        from mindspeed_proxy.patches.runtime import RUNTIME

        RUNTIME.tensorboard_writer = writer  # the monitor is built with the optimizer, in Trainer()
    trainer = Trainer(A.model_config(args), A.train_config(args))
    monitor = _active_monitor()
    parts = {MONITOR_KEY: MonitorPart(monitor)} if monitor is not None else {}
    start = 0
    if args.load:
        loader = C.loader(load_format)
        try:
            info = loader(args.load, trainer, args.ckpt_step,
                          load_optim=not (args.finetune or args.no_load_optim),
                          load_rng=not (args.finetune or args.no_load_rng),
                          parts=None if args.finetune else parts)
        except ValueError as exc:  # every rank refuses alike; nothing has been written yet
            if rank0:
                error(prog, exc)
            raise SystemExit(2) from None
        start = 0 if args.finetune else info["iteration"]
        _print_rank0(f" loaded {load_format} checkpoint from {args.load} at iteration {info['iteration']}")
        if monitor is not None:
            from mindspeed_proxy.monitor.run_log import RunFolderError

            try:
                monitor.weights_loaded()
            except RunFolderError as exc:  # a checkpoint without monitor state, into another run's folder
                if rank0:
                    error(prog, exc)
                raise SystemExit(2) from None
    log_dir = resolve_log_dir(args)
    metrics = MetricsWriter(log_dir, args, enabled=rank0)
    saver = C.saver(args.ckpt_format)
    skipped = 0
    for iteration in range(start, args.train_iters):
        ids = microbatch_sample_ids(trainer.cfg, iteration)
        batches = [data.get_batch(train_ds, mb) for mb in ids]
        t0 = time.perf_counter()
        result = trainer.train_step(batches)
        seconds = time.perf_counter() - t0
        skipped += int(result["skipped"])
        step = iteration + 1
        tokens = args.global_batch_size * args.seq_length
        metrics.write({"type": "step", "iteration": step, "loss": result["loss"],
                       "grad_norm": result["grad_norm"], "lr": result["lr"],
                       "tokens_per_s": tokens / seconds, "step_time_s": seconds,
                       "skipped": result["skipped"]})
        W.log_scalars(writer, step, result, W.STEP_SCALARS, "train")
        if result["nonfinite"] and args.check_for_nan_in_loss_and_grad:
            metrics.close()
            stop_nonfinite(prog, step, args)
        if step % args.log_interval == 0:
            _print_rank0(_format_step(step, args.train_iters, step * args.global_batch_size,
                                      seconds * 1000, result, args.global_batch_size, skipped))
        if args.save and (step == args.train_iters or (args.save_interval and step % args.save_interval == 0)):
            saver(args.save, step, trainer, args, parts=parts)
            _print_rank0(f" saved {args.ckpt_format} checkpoint at iteration {step} to {args.save}")
    metrics.close()
    _print_rank0(f" metrics written to {metrics.path}")
    if monitor is not None:
        _print_rank0(f" mechanism monitor: {len(monitor.alerts)} alert(s); records in {monitor.config.output_dir}")
        monitor.close()
    W.close(writer)
    finish_distributed()
    return 0
