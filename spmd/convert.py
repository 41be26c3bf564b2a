"""`python -m spmd.convert`: Hugging Face folders (every architecture a model family reads) <->
spmd checkpoint folders.

    python -m spmd.convert --from-hf path/to/hf_llama --to ckpt/llama      # HF -> spmd
    python -m spmd.convert --checkpoint runs/ckpt --to-hf out/hf_llama     # spmd -> HF

HF -> spmd streams each tensor from the safetensors files onto the param shardings of `--mesh`
(models/hf_io.py, by the table of the family its config.json names) and writes a params-only
checkpoint (step 0) that `spmd.generate --checkpoint` and `--to-hf` read; spmd.io.params_io
says why `spmd.train --resume` refuses it (`--init-from-hf` trains from the HF folder instead).
spmd -> HF reads the params of a checkpoint's newest step (or `--step`) and writes config.json
and safetensors (`--hf-dtype float32` by default, so the round trip is bit-exact; `bfloat16`
halves the size), sharded at `--max-shard-mb`, with the run's `--tokenizer` file (recorded
absolute, spmd.io.run_paths; `--tokenizer` names a moved one) copied beside them as
tokenizer.json. A LoRA checkpoint exports merged (`--to-hf`) or as peft adapters
(`--to-peft`); its base is read from where it recorded it, or `--lora-base`. Neither direction
overwrites an existing checkpoint, writes into its own input, or writes into a run's folders
(spmd.training.occupied: a live run's, a run folder, a checkpoint folder). Both directions run
in one process (the export gathers each tensor to that host).

The text files of a Hugging Face folder (TEXT_FILES: the tokenizer, its config with the chat
template, the generation config) travel both ways: --from-hf copies them into the checkpoint's
`tokenizer/` folder, whose tokenizer.json the checkpoint names relative to itself (so the
checkpoint can move), and --to-hf writes them back beside the weights."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Literal

from spmd import paths
from spmd.errors import UsageError, run_command
from spmd.io import eos, hub, run_paths, templates
from spmd.run import config, output_paths
from spmd.sections import MeshConfig
from spmd.training import occupied


@dataclasses.dataclass(frozen=True)
class ConvertConfig:
    """Which way to convert, and on which mesh the params are held on the way."""

    from_hf: str = ""  # a Hugging Face folder (config.json, *.safetensors) or Hub id to read
    to: str = ""  # the spmd checkpoint folder to write (with --from-hf)
    checkpoint: str = ""  # an spmd checkpoint folder to read (with --to-hf)
    step: int = 0  # its step to read (0: the newest)
    to_hf: str = ""  # the Hugging Face folder to write (with --checkpoint; LoRA: merged)
    # a peft LoRA folder (adapter_config.json, adapter_model.safetensors) to write of a LoRA
    # checkpoint's adapters (with --checkpoint)
    to_peft: str = ""
    # the folder of a LoRA checkpoint's base when it is no longer where the checkpoint recorded
    # it (moved, or another copy): its content hash must match (empty: the recorded folder)
    lora_base: str = ""
    # the tokenizer.json (or its folder, or a Hub id) to write beside --to-hf's weights, with
    # the chat template and generation config beside it (empty: the checkpoint's)
    tokenizer: str = ""
    hf_dtype: Literal["float32", "bfloat16"] = "float32"  # dtype of the written safetensors
    max_shard_mb: int = 4096  # largest safetensors file written (MiB)


# The files of a Hugging Face folder that describe its text rather than its tensors, which a
# round trip keeps; a converted checkpoint holds them in its TEXT_FOLDER.
TEXT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",  # the special tokens and the chat template
    "chat_template.jinja",  # where newer transformers save the template instead
    "special_tokens_map.json",
    "generation_config.json",  # eos, bos and sampling defaults of transformers' generate
)
TEXT_FOLDER = "tokenizer"

# spmd.convert's own default of a MeshConfig field: the params sharded over every device on
# the way, the least memory per device (training's and generate's default is "dp=-1").
DEFAULTS = {"mesh": "fsdp=-1"}


def main(argv: list[str] | None = None) -> int:
    return run_command(run, argv)


def run(argv: list[str] | None) -> int:
    sections = {"convert": ConvertConfig, "mesh": MeshConfig}
    about = __doc__.split("\n\n")[0]
    resolved = config.resolve(
        argv, sections, "python -m spmd.convert", defaults=DEFAULTS, description=about
    )
    cfg, where = resolved["convert"], resolved["mesh"]
    to_spmd = bool(cfg.from_hf and cfg.to) and not (cfg.checkpoint or cfg.to_hf or cfg.to_peft)
    exports = bool(cfg.to_hf) + bool(cfg.to_peft)
    to_hf = bool(cfg.checkpoint) and exports == 1 and not (cfg.from_hf or cfg.to)
    if to_spmd == to_hf:
        raise UsageError(
            "give either --from-hf DIR --to CKPT_DIR (HF -> spmd) or --checkpoint CKPT_DIR "
            "--to-hf DIR (spmd -> HF) or --checkpoint CKPT_DIR --to-peft DIR (LoRA adapters)"
        )
    check_choices(cfg, where, to_spmd)
    cfg = hub.resolve_section(cfg)  # a Hub id in --from-hf: its cached snapshot folder
    source = ("--from-hf", cfg.from_hf) if to_spmd else ("--checkpoint", cfg.checkpoint)
    outputs = {"--to": cfg.to, "--to-hf": cfg.to_hf, "--to-peft": cfg.to_peft}
    for flag, target in outputs.items():
        if target:  # only the output given: an empty one would stand for the current folder
            check_apart(*source, flag, target)
            if not paths.is_url(target):
                output_paths.check_folder(flag, target)  # a folder can be made and written
                occupied.check_free(flag, target)  # not a live run's, nor inside a run's folders
    from models import family, finetune
    from spmd.io import checkpoint, params_io
    from spmd.run import weights

    started = time.perf_counter()
    if to_spmd:
        if Path(cfg.to).exists() and (
            checkpoint.complete_steps(cfg.to) or not Path(cfg.to).is_dir()
        ):
            raise UsageError(
                f"--to {cfg.to} already exists with checkpoints or as a file; give a new folder"
            )
        folder = family.open_hf(cfg.from_hf)  # every error before any device work
        layout = weights.setup_layout(where.mesh, where.devices, where.zero)
        loaded = weights.from_hf(cfg.from_hf, layout)
        text_files = [
            Path(cfg.from_hf) / n for n in TEXT_FILES if (Path(cfg.from_hf) / n).is_file()
        ]
        tokenizer = f"{TEXT_FOLDER}/tokenizer.json"  # relative to the checkpoint folder
        saved = {
            "model": dataclasses.asdict(loaded.model),
            "tokenizer": tokenizer if (Path(cfg.from_hf) / "tokenizer.json").is_file() else "",
            # what config.json declares, so that spmd.generate bounds the checkpoint alike
            weights.MAX_POSITIONS: folder.raw_config.get("max_position_embeddings"),
            eos.KEY: eos.declared(cfg.from_hf),  # where spmd.generate stops
        }
        with occupied.hold(cfg.to):  # no run or other conversion writes --to meanwhile
            origin = str(Path(cfg.from_hf).absolute())
            params_io.save_converted(cfg.to, loaded.params, saved, origin)
            copy_files(text_files, Path(cfg.to) / TEXT_FOLDER)
        kept = f", {len(text_files)} tokenizer files" if text_files else ""
        target = f"spmd checkpoint {cfg.to} (step {params_io.CONVERTED_STEP}, params only{kept})"
    elif cfg.to_peft:
        params_io.pick_step(cfg.checkpoint, cfg.step)
        layout = weights.setup_layout(where.mesh, where.devices, where.zero)
        loaded = weights.from_checkpoint(cfg.checkpoint, cfg.step, layout, cfg.lora_base)
        if loaded.lora is None:
            raise UsageError(f"--to-peft: {cfg.checkpoint} is not a LoRA run (--lora-rank 0)")
        # the base the adapters were checked against, absolute: peft reads it from any folder
        base = run_paths.absolute(loaded.base)
        files = finetune.save_peft(loaded.adapters, loaded.lora, loaded.model, cfg.to_peft, base)
        target = f"peft adapter {cfg.to_peft} ({len(files)} files, rank {loaded.lora.rank})"
    else:
        family.check_new_folder(cfg.to_hf)
        params_io.pick_step(cfg.checkpoint, cfg.step)  # the folder and step, before the mesh
        layout = weights.setup_layout(where.mesh, where.devices, where.zero)
        loaded = weights.from_checkpoint(cfg.checkpoint, cfg.step, layout, cfg.lora_base)
        seq_len = config.flat_values(loaded.run_config).get("seq_len", 2048)
        text_source = export_tokenizer(cfg, loaded.run_config)  # before anything is written
        files = family.save_hf(
            loaded.params,
            loaded.model,
            cfg.to_hf,
            cfg.hf_dtype,
            cfg.max_shard_mb << 20,
            max_positions=seq_len,
        )
        files += export_text_files(text_source, loaded.run_config, Path(cfg.to_hf))
        target = f"Hugging Face folder {cfg.to_hf} ({len(files)} files, {cfg.hf_dtype})"
        if loaded.lora is not None and loaded.lora.base_dtype:
            # QLoRA: the export holds what the run computed with, not the base it started from
            target += (
                f", the adapters merged into the {loaded.lora.base_dtype} base dequantized "
                f"(its weights differ from the original base by the quantization error)"
            )
    n_params = family.of(loaded.model).n_params(loaded.model)
    print(
        f"converted {loaded.source} ({n_params / 1e6:.2f} M params) to {target} "
        f"in {time.perf_counter() - started:.1f} s"
    )
    return 0


def copy_files(files: list[Path], folder: Path) -> list[Path]:
    """Copy `files` into `folder` (made), keeping their names; the copies."""
    if files:
        folder.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(path, folder / path.name)) for path in files]


def export_tokenizer(cfg: ConvertConfig, run_config: dict) -> Path | None:
    """The tokenizer.json to write beside an export: --tokenizer, else the checkpoint's (spmd.
    io.run_paths); None for a byte-level run. UsageError when neither is a file, so that an
    export never leaves out a tokenizer its model was trained with."""
    if cfg.tokenizer:
        if not Path(cfg.tokenizer).is_file():
            raise UsageError(f"--tokenizer {cfg.tokenizer}: no such file; give a tokenizer.json")
        return Path(cfg.tokenizer)
    found = run_paths.tokenizer_file(cfg.checkpoint, run_config)
    named = run_paths.tokenizer_named(run_config)
    if found is None and named:
        raise UsageError(
            f"--checkpoint {cfg.checkpoint} names the tokenizer {named}, which is "
            f"not there any more; give it with --tokenizer PATH (its folder's chat template and "
            f"generation config go with it)"
        )
    return found


def export_text_files(tokenizer: Path | None, run_config: dict, folder: Path) -> list[Path]:
    """Write the text files beside exported weights: `tokenizer` and the TEXT_FILES beside it
    (the chat template's config, a kept generation_config.json), else a
    generation_config.json of the checkpoint's end-of-sequence ids."""
    found = [tokenizer.parent / n for n in TEXT_FILES] if tokenizer is not None else []
    files = copy_files([p for p in found if p.is_file() and p != tokenizer], folder)
    if tokenizer is not None:  # a run's tokenizer file may have any name; HF's is this one
        files.append(Path(shutil.copyfile(tokenizer, folder / "tokenizer.json")))
    if not (folder / "generation_config.json").is_file():
        files += write_generation_config(folder, eos.ids(run_config.get(eos.KEY)))
    text = run_config.get(templates.SAVED_KEY)
    if isinstance(text, str):  # (over a copied chat_template.jinja of the tokenizer's)
        written = write_chat_template(folder, text)
        files = [f for f in files if f != written] + [written]
    return files


def write_chat_template(folder: Path, text: str) -> Path:
    """The run's --chat-template `text` written as transformers 5 saves a tokenizer's template:
    `chat_template.jinja`, and no `chat_template` left in tokenizer_config.json (where the
    tokenizer's own would otherwise disagree with it)."""
    path = folder / templates.EXPORTED_FILE
    path.write_text(text, encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if config.is_file():
        values = json.loads(config.read_text())
        if isinstance(values, dict) and values.pop("chat_template", None) is not None:
            config.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n")
    return path


def check_apart(source_flag: str, source: str, target_flag: str, target: str) -> None:
    """UsageError when the folder written is the folder read, or one holds the other: the
    conversion would write into (or next to, and then over) its own input."""
    read, written = Path(source).resolve(), Path(target).resolve()
    if read == written or read in written.parents or written in read.parents:
        relation = "is" if read == written else "is inside" if read in written.parents else "holds"
        raise UsageError(
            f"{target_flag} {target} {relation} {source_flag} {source}; write the conversion to "
            f"a folder of its own"
        )


def write_generation_config(folder: Path, eos_ids: list[int]) -> list[Path]:
    """generation_config.json declaring `eos_ids` (the ids a converted checkpoint kept), so that
    transformers' generate stops where spmd.generate does; nothing when there are none."""
    if not eos_ids:
        return []
    path = folder / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}))
    return [path]


def check_choices(cfg: ConvertConfig, where: MeshConfig, to_spmd: bool) -> None:
    """UsageError for values out of range, and for the other direction's flags given with a
    value (they would be ignored), before any device work."""
    from models import family
    from spmd.parallel.mesh import check_section

    if cfg.max_shard_mb < 1:
        raise UsageError(f"--max-shard-mb {cfg.max_shard_mb} must be at least 1")
    if cfg.hf_dtype not in family.EXPORT_DTYPES:
        raise UsageError(
            f"--hf-dtype {cfg.hf_dtype!r} is not one of {', '.join(family.EXPORT_DTYPES)}"
        )
    if cfg.step < 0:
        raise UsageError(f"--step {cfg.step} must be a checkpoint step, or 0 (the newest)")
    check_section(where)
    defaults = ConvertConfig()
    export_only: dict[str, object] = {"step": cfg.step, "hf_dtype": cfg.hf_dtype}
    export_only.update(max_shard_mb=cfg.max_shard_mb, lora_base=cfg.lora_base)
    export_only.update(tokenizer=cfg.tokenizer)
    for name, value in export_only.items() if to_spmd else ():
        if value != getattr(defaults, name):
            raise UsageError(
                f"{config.flag_name(name)} {value} is for --checkpoint (spmd -> HF, peft); "
                f"--from-hf --to does not use it"
            )
    hf_only: dict[str, object] = {"hf_dtype": cfg.hf_dtype, "max_shard_mb": cfg.max_shard_mb}
    hf_only["tokenizer"] = cfg.tokenizer
    for name, value in hf_only.items() if cfg.to_peft else ():
        if value != getattr(defaults, name):
            raise UsageError(
                f"{config.flag_name(name)} {value} is for --to-hf; --to-peft writes the "
                f"adapters alone"
            )


if __name__ == "__main__":
    sys.exit(main())
