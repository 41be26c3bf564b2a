"""`python -m spmd.train`: train the Llama model on any mesh, printing and logging progress.

    python -m spmd.train [--config configs/X.toml] [--model tiny] [--mesh dp=2,tp=4] [...]

The resolved config is printed first; `--dry-run` compiles the step and reports per-device
memory and the compiled collectives without training. User mistakes exit with status 2 and one
line naming the bad value.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from models import llama
from spmd import config, data
from spmd.config import TrainConfig
from spmd.errors import UsageError
from spmd.metrics import MetricsLog, progress_line, say

SECTIONS = {"model": llama.LlamaConfig, "train": TrainConfig}


def expand_layout(values: dict[str, Any]) -> dict[str, Any]:
    """A named --layout fills --mesh and --zero where they were not given."""
    if not values.get("layout"):
        return values
    import meshes

    preset = meshes.get(values["layout"])
    return {"mesh": preset.mesh, "zero": preset.zero, **values}


def check_choices(train: TrainConfig, model: llama.LlamaConfig) -> None:
    """UsageError for values outside their valid range (before any device work)."""
    positive = {
        "steps": train.steps,
        "batch": train.batch,
        "seq_len": train.seq_len,
        "log_every": train.log_every,
        "eval_batches": train.eval_batches,
    }
    for name, value in positive.items():
        if value < 1:
            raise UsageError(f"{config.flag_name(name)} {value} must be a positive integer")
    if train.devices < 0:
        raise UsageError(f"--devices {train.devices} must be 0 (as needed) or a device count")
    if not 0 <= train.eval_fraction < 1:
        raise UsageError(f"--eval-fraction {train.eval_fraction} must be in [0, 1)")
    if model.remat not in llama.REMAT_POLICIES:
        raise UsageError(f"--remat {model.remat!r} is not one of {', '.join(llama.REMAT_POLICIES)}")
    if model.vocab_size < data.BYTE_VOCAB:
        raise UsageError(
            f"--vocab-size {model.vocab_size} is smaller than the {data.BYTE_VOCAB} byte tokens "
            f"of the data; use at least {data.BYTE_VOCAB}"
        )
    if model.n_heads % model.n_kv_heads:
        raise UsageError(f"--n-kv-heads {model.n_kv_heads} must divide --n-heads {model.n_heads}")


def setup_mesh(train: TrainConfig):
    """Simulate CPU devices if needed (before JAX starts), then build the mesh."""
    from spmd import mesh as mesh_lib

    sizes = mesh_lib.parse_mesh(train.mesh)
    needed = mesh_lib.devices_needed(sizes)
    if train.devices:
        if not mesh_lib.cpu_only():
            raise UsageError(
                f"--devices {train.devices} simulates CPU devices, but this machine has "
                f"accelerators; drop --devices to use them"
            )
        mesh_lib.simulate_cpu_devices(train.devices, announce=False)
    elif needed and needed > 1 and mesh_lib.cpu_only():
        mesh_lib.simulate_cpu_devices(needed)
    return mesh_lib.build_mesh(sizes)


def pipeline_of(train: TrainConfig, model: llama.LlamaConfig, layout: Any) -> tuple:
    """(spmd.pipeline.Pipeline, its schedule report) when the mesh has pp > 1, else (None,
    None); prints the schedule's bubble and idle share. UsageError for a schedule that cannot
    run (layers, micro-batches or batch that do not split)."""
    stages = layout.mesh.shape["pipeline"]
    if stages == 1:
        return None, None
    from spmd import pipeline

    pipe = pipeline.Pipeline(
        train.pp_schedule, train.microbatches, train.pp_virtual, llama.logits_loss
    )
    pipeline.check(pipe, layout, model.n_layers, train.batch, train.accum)
    report = pipeline.report(pipe, stages)
    say(
        f"pipeline: {report['schedule']} over {stages} stages x {report['virtual']} chunks, "
        f"{report['microbatches']} micro-batches | bubble (p-1)/(M+p-1)/v "
        f"{report['bubble_theory']:.3f} | idle share of the tick table run "
        f"{report['idle_fraction']:.3f} ({report['ticks']} ticks, {report['stash_slots']} "
        f"stashed inputs per stage)"
    )
    return pipe, report


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(argv: list[str] | None) -> int:
    sections = config.resolve(argv, SECTIONS, "python -m spmd.train", expand_train=expand_layout)
    train, model_cfg = sections["train"], sections["model"]
    check_choices(train, model_cfg)
    say(config.format_config(sections))
    mesh = setup_mesh(train)

    import jax

    from spmd import hlo
    from spmd.mesh import format_mesh
    from spmd.optim import make_optimizer, peak_lr
    from spmd.step import Layout, build_program, check_batch, state_bytes_per_device

    layout = Layout(mesh, train.zero)
    check_batch(train.batch, layout, train.accum)
    mesh_text = format_mesh(dict(mesh.shape))
    device_kind = jax.devices()[0].device_kind
    micro = train.batch // (layout.data_parallel * train.accum)
    say(
        f"mesh {mesh_text} ({mesh.size} x {device_kind}), zero {train.zero} | "
        f"{model_cfg.n_params() / 1e6:.2f} M params | per-device micro-batch {micro} x accum "
        f"{train.accum} x data-parallel {layout.data_parallel} = global batch {train.batch} | "
        f"lr {train.lr:g} -> {peak_lr(train):g} ({train.lr_scaling} scaling)"
    )
    pipe, pipe_report = pipeline_of(train, model_cfg, layout)
    program = build_program(
        lambda seed: llama.create(model_cfg, seed),
        llama.lm_loss,
        lambda names: make_optimizer(train, names),
        layout,
        seed=train.seed,
        accum=train.accum,
        pipeline=pipe,
    )
    started = time.perf_counter()
    compiled = program.compile_train_step(train.batch, train.seq_len)
    compile_s = time.perf_counter() - started
    state_bytes = state_bytes_per_device(compiled, program)
    say(
        f"compiled the train step in {compile_s:.1f} s | per device: params "
        f"{state_bytes['params'] / 2**20:.2f} MiB, optimizer state "
        f"{state_bytes['opt_state'] / 2**20:.2f} MiB"
    )
    if train.dry_run:
        summary = hlo.collective_summary(hlo.collectives(compiled, mesh))
        say(hlo.format_report(summary, hlo.memory(compiled)))
        return 0

    log = MetricsLog(train.metrics)
    log.write(
        "config",
        config=config.as_dict(sections),
        mesh=dict(mesh.shape),
        mesh_text=mesh_text,
        devices=mesh.size,
        device_kind=device_kind,
        platform=jax.devices()[0].platform,
        n_params=model_cfg.n_params(),
        state_bytes_per_device=state_bytes,
        compile_s=compile_s,
        pipeline=pipe_report,
    )
    try:
        train_loop(train, program, compiled, log)
    finally:
        log.close()
    return 0


def train_loop(train: TrainConfig, program: Any, compiled: Any, log: MetricsLog) -> None:
    """Run the optimizer steps. Metrics of a logged step are fetched only after the next step
    is dispatched, so the host never stalls the device."""
    import jax
    import numpy as np

    from spmd.optim import lr_schedule

    files = data.corpus_files(train.data)
    windows = data.TokenWindows(data.byte_tokens(files), train.seq_len, train.eval_fraction)
    say(
        f"data: {len(files)} file(s), {len(windows.tokens) / 1e6:.2f} M tokens, "
        f"{windows.n_train} train / {windows.n_eval} eval windows of {train.seq_len + 1}"
    )
    batch_sharding = program.layout.batch_sharding()
    schedule = lr_schedule(train)
    tokens_per_step = train.batch * train.seq_len
    eval_step = program.eval_step.lower(
        program.abstract_params, program.abstract_batch(train.batch, train.seq_len)
    ).compile()

    def evaluate(params: Any, step: int) -> float:
        losses = [
            eval_step(
                params,
                data.global_batch(
                    windows, data.eval_window_ids(i, train.batch, windows), batch_sharding
                ),
            )
            for i in range(train.eval_batches)
        ]
        loss = float(np.mean(jax.device_get(losses)))
        log.write("eval", step=step, loss=loss)
        say(f"eval at step {step}: loss {loss:.4f}")
        return loss

    params, opt_state = program.init()
    step_times: list[float] = []
    last = {"step": 0, "time": time.perf_counter()}

    def report(step: int, metrics: dict) -> None:
        metrics = jax.device_get(metrics)
        now = time.perf_counter()
        step_time = (now - last["time"]) / (step - last["step"])
        last.update(step=step, time=now)
        step_times.append(step_time)
        record = {
            "step": step,
            "loss": float(metrics["loss"]),
            "grad_norm": float(metrics["grad_norm"]),
            "lr": float(schedule(step - 1)),
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_step / step_time,
        }
        log.write("train", **record)
        say(
            progress_line(
                step,
                train.steps,
                record["loss"],
                record["grad_norm"],
                step_time,
                record["tokens_per_s"],
            )
        )
        final.update(record)

    final: dict[str, Any] = {}
    eval_loss = None
    pending = None
    for step in range(1, train.steps + 1):
        ids = data.train_window_ids(train.seed, step - 1, train.batch, windows.n_train)
        batch = data.global_batch(windows, ids, batch_sharding)
        params, opt_state, metrics = compiled(params, opt_state, batch)
        if pending is not None:
            report(*pending)
            pending = None
        if step % train.log_every == 0 or step == train.steps:
            pending = (step, metrics)
        if windows.n_eval and train.eval_every and step % train.eval_every == 0:
            if pending is not None:
                report(*pending)
                pending = None
            eval_loss = evaluate(params, step)
            last["time"] = time.perf_counter()  # eval time is not step time
    if pending is not None:
        report(*pending)
    if windows.n_eval and (not train.eval_every or train.steps % train.eval_every):
        eval_loss = evaluate(params, train.steps)
    median_step = statistics.median(step_times[1:] or step_times)
    log.write(
        "summary",
        steps=train.steps,
        final_loss=final["loss"],
        eval_loss=eval_loss,
        median_step_time_s=median_step,
        tokens_per_s=tokens_per_step / median_step,
    )
    say(
        f"done: {train.steps} steps, final loss {final['loss']:.4f}, eval loss "
        f"{eval_loss if eval_loss is None else round(eval_loss, 4)}, median "
        f"{median_step * 1e3:.1f} ms/step, {tokens_per_step / median_step:,.0f} tokens/s"
    )


if __name__ == "__main__":
    sys.exit(main())
