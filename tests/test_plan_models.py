"""The planner on real models (`python -m spmd.plan`): a Hugging Face folder or Hub id planned
from its config.json alone with its true parameter count, `--params` as a current release's
published shape, a learning rate suggested for the planned size, and LoRA's lines saying what
LoRA keeps. In-process, no compile: about 3 s in all."""

import json
import math
import shutil
import struct
from pathlib import Path

import huggingface_hub.constants
import pytest

from spmd import plan
from spmd.estimate import shape
from tests.test_hub import lay_out_repo

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def plan_json(capsys, *args: str) -> dict:
    assert plan.main([*args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def plan_text(capsys, *args: str) -> str:
    assert plan.main(list(args)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def safetensors_params(folder: Path) -> int:
    """Scalars in a folder's safetensors files, read from their headers: the model's count."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


@pytest.mark.parametrize("fixture", ["hf_llama3", "hf_qwen3", "hf_qwen3_moe", "hf_gemma2"])
def test_a_hugging_face_config_json_is_planned_with_its_true_parameter_count(
    fixture, tmp_path, capsys
):
    # the config.json alone, as a user has it before downloading the weights
    folder = tmp_path / fixture
    folder.mkdir()
    shutil.copy(FIXTURES / fixture / "config.json", folder)
    out = plan_json(capsys, "--init-from-hf", str(folder), "--devices", "4", "--recommend")
    assert out["n_params"] == safetensors_params(FIXTURES / fixture)
    assert out["model"].startswith(f"--init-from-hf {folder} (")
    config = json.loads((folder / "config.json").read_text())
    assert out["shape"]["embed_dim"] == config["hidden_size"]
    assert out["shape"]["n_layers"] == config["num_hidden_layers"]
    command = out["recommendation"]["train_command"]
    assert f"--init-from-hf {folder} " in command and "--vocab-size" not in command


def test_a_hub_id_is_planned_from_its_cached_config_json(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "hub"
    lay_out_repo(cache, "tiny-org/qwen3", {"config.json": FIXTURES / "hf_qwen3" / "config.json"})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = plan_json(capsys, "--init-from-hf", "tiny-org/qwen3", "--devices", "2", "--recommend")
    assert out["n_params"] == safetensors_params(FIXTURES / "hf_qwen3")
    assert "--init-from-hf tiny-org/qwen3 " in out["recommendation"]["train_command"]


def test_params_and_a_model_folder_together_exit_2(capsys):
    folder = str(FIXTURES / "hf_llama3")
    assert plan.main(["--params", "8e9", "--init-from-hf", folder]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--params 8e+09" in err[0] and "--init-from-hf" in err[0], err


# Published parameter counts (the releases' safetensors totals)
PUBLISHED = {
    "Llama 3.2 1B": 1_235_814_400,
    "Llama 3.2 3B": 3_212_749_824,
    "Llama 3.1 8B": 8_030_261_248,
    "Llama 3.1 70B": 70_553_706_496,
    "Llama 3.1 405B": 405_853_388_800,
}


def test_params_plans_a_current_releases_shape_and_says_which(capsys):
    releases = {r.name: r for r in shape.RELEASES}
    for name, count in PUBLISHED.items():
        assert releases[name].n_params() == count, name
    out = plan_json(capsys, "--params", "8e9", "--devices", "8")
    assert out["shape"] == {
        "vocab_size": 128256,
        "embed_dim": 4096,
        "mlp_dim": 14336,
        "n_layers": 32,
        "n_heads": 32,
        "n_kv_heads": 8,  # GQA, not Llama 2's 32
        "head_dim": 128,
    }
    assert "Llama 3.1 8B's shape (8.03 B params" in out["model"]
    assert shape.release_for(70e9).name == "Llama 3.1 70B"
    assert shape.release_for(14e9).name == "Qwen3-14B"


def train_lr(out: dict) -> str | None:
    """The --lr of the recommended spmd.train command (None: the default)."""
    words = out["recommendation"]["train_command"].split()
    return words[words.index("--lr") + 1] if "--lr" in words else None


def test_the_suggested_learning_rate_falls_with_the_width(capsys):
    # 3e-4 x 4096 / embed: Llama 3's 8B and 70B peak rates
    big = plan_json(capsys, "--params", "8e9", "--devices", "8", "--recommend")
    assert train_lr(big) == "0.0003" and big["lr"]["peak_lr"] == 3e-4
    assert "3e-4 x 4096 / embed 4096 (pretraining)" in big["lr"]["source"]
    wide = plan_json(capsys, "--params", "70e9", "--devices", "64", "--recommend")
    assert train_lr(wide) == "0.00015"
    lora_run = plan_json(capsys, "--params", "8e9", "--lora-rank", "16", "--recommend")
    assert train_lr(lora_run) == "0.0002"
    hf = str(FIXTURES / "hf_llama3")
    tuned = plan_json(capsys, "--init-from-hf", hf, "--devices", "2", "--lr", "1e-5", "--recommend")
    assert train_lr(tuned) == "1e-05" and tuned["lr"]["source"] == "given"
    # the small preset is what the --lr default was tuned for: nothing to add
    small = plan_json(capsys, "--model", "small", "--devices", "8", "--recommend")
    assert train_lr(small) is None and small["lr"]["lr"] == 3e-3
    text = plan_text(capsys, "--params", "8e9", "--devices", "8")
    assert "lr 0.0003 -> 0.0003" in text and "rule 3e-4 x 4096 / embed 4096" in text


def test_lora_lines_say_what_lora_keeps(capsys):
    args = ("--params", "8030261248", "--devices", "8", "--lora-rank", "16", "--recommend")
    out = plan_json(capsys, *args)
    adapters = out["lora"]["adapter_params"]
    # rank 16 on q, o (4096 + 4096), k, v (4096 + 1024), gate, up, down (4096 + 14336), 32 layers
    assert adapters == 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18432)
    text = plan_text(capsys, *args)
    assert "plain DDP keeps 16 B/param" not in text
    kept = f"the frozen base 2 B/param, the {adapters / 1e6:.2f} M adapter params 2 + 2 + 12"
    assert f"plain DDP keeps {kept} = 16 B/param on every device" in text
    assert f"memory per device (1 GB = 1e9 bytes)       {kept}" in text
    # and the number beside it is that arithmetic: base x 2 + adapters x 16 + the overhead
    state = (2 * 8030261248 + 16 * adapters + 3e9) / 1e9
    assert f"on every device: {state:.1f} GB with the overhead" in text
