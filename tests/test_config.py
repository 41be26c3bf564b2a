"""Mesh strings, config precedence, choices, --print-config and the data order, without
compiling anything."""

import tomllib
from pathlib import Path

import numpy as np
import pytest

from models.llama import LlamaConfig
from spmd import bench, plan, train
from spmd.errors import UsageError
from spmd.io import data
from spmd.parallel.mesh import format_mesh, parse_mesh, resolve_mesh
from spmd.run import config, run_setup
from spmd.run.resolve import expand_layout, sections
from spmd.sections import Config, RunConfig, choices


def test_mesh_aliases_and_the_rest():
    sizes = parse_mesh("data=2,TP=-1")
    want = {"data": 2, "pipeline": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": -1}
    assert sizes == want
    assert resolve_mesh(sizes, 8) == {
        "data": 2,
        "pipeline": 1,
        "fsdp": 1,
        "expert": 1,
        "context": 1,
        "tensor": 4,
    }
    assert format_mesh(resolve_mesh(sizes, 8)) == "dp=2,tp=4"
    assert format_mesh(resolve_mesh(parse_mesh("context=2,tp=-1"), 8)) == "cp=2,tp=4"


@pytest.mark.parametrize("spec", ["dp=2,dp=2", "dp=0", "dp=two", "dp", "dp=3,tp=-1"])
def test_bad_mesh_strings(spec):
    with pytest.raises(UsageError):
        resolve_mesh(parse_mesh(spec), 8)


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "source",
    [
        ["--init-from-hf", "tests/fixtures/hf_gemma2"],
        ["--init-from-peft", "tests/fixtures/peft_llama", "--lora-dropout", "0.1"],
    ],
)
def test_train_bench_and_plan_resolve_the_run_in_one_place(source, monkeypatch):
    """spmd.run.resolve.run_config turns the flags and the folders a run names into its model
    and [lora] section, the same for the three commands that run or plan a training run (bench
    timed the --model preset's model before, whatever --init-from-hf or --init-from-peft said)."""
    monkeypatch.chdir(ROOT)  # peft wrote base_model_name_or_path relative to the repository
    trained = train.resolve_sections(source)
    assert trained["model"].family in ("gemma2", "llama") and trained["run"].init_from_hf
    for other in (bench.resolve_sections(source), plan.resolve_sections(source)):
        assert other["model"] == trained["model"]
        assert other["lora"] == trained["lora"]
        assert other["run"].init_from_hf == trained["run"].init_from_hf


def resolve(*argv, **kwargs):
    return config.resolve(list(argv), sections(), "test", expand=expand_layout, **kwargs)


def test_precedence_defaults_preset_file_flags(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text('[train]\nmodel = "tiny"\nsteps = 7\n[model]\nn_layers = 2\n')
    resolved = resolve("--config", str(file), "--steps", "9")
    assert resolved["run"].steps == 9  # flag beats file
    assert resolved["model"].n_layers == 2  # file beats preset
    assert resolved["model"].embed_dim == 64  # the tiny preset
    assert resolved["run"].batch == RunConfig().batch  # dataclass default
    assert isinstance(resolved["model"], LlamaConfig)


def test_sectioned_tables_and_the_flat_train_table_read_alike(tmp_path):
    sectioned, flat = tmp_path / "sectioned.toml", tmp_path / "flat.toml"
    sectioned.write_text(
        '[run]\nmodel = "tiny"\nsteps = 7\n[optimizer]\nlr = 0.01\n[parallel]\nzero = 2\n'
    )
    flat.write_text('[train]\nmodel = "tiny"\nsteps = 7\nlr = 0.01\nzero = 2\n')
    a, b = resolve("--config", str(sectioned)), resolve("--config", str(flat))
    assert config.as_dict(a) == config.as_dict(b)
    assert (a["run"].steps, a["optimizer"].lr, a["parallel"].zero) == (7, 0.01, 2)
    misplaced = tmp_path / "misplaced.toml"
    misplaced.write_text("[optimizer]\nmesh = 'dp=2'\n")
    with pytest.raises(UsageError, match="unknown key 'mesh'"):
        resolve("--config", str(misplaced))


def test_layout_fills_mesh_and_zero_unless_given():
    assert resolve("--layout", "zero1")["parallel"].mesh == "fsdp=-1"
    assert resolve("--layout", "zero1")["parallel"].zero == 1
    assert resolve("--layout", "zero1", "--mesh", "fsdp=4")["parallel"].mesh == "fsdp=4"


@pytest.mark.parametrize(
    "given, mode",
    [
        ((), "auto"),
        (("--resume",), "required"),
        (("--resume", "fresh"), "fresh"),
        (("--resume", "true"), "required"),  # the command lines of the bool --resume
        (("--resume", "false"), "fresh"),
        (("--resume", "--steps", "3"), "required"),
        (("--toml", "[checkpoint]\nresume = true\n"), "required"),  # files of the bool
        (("--toml", "[train]\nresume = false\n"), "fresh"),
        (("--toml", '[checkpoint]\nresume = "auto"\n', "--resume"), "required"),
    ],
)
def test_resume_modes_and_the_values_of_the_former_bool(tmp_path, given, mode):
    argv = list(given)
    if argv[:1] == ["--toml"]:
        (tmp_path / "c.toml").write_text(argv[1])
        argv[:2] = ["--config", str(tmp_path / "c.toml")]
    assert resolve(*argv)["checkpoint"].resume == mode


def test_config_file_mistakes_are_named(tmp_path):
    file = tmp_path / "bad.toml"
    file.write_text("[train]\nstepz = 3\n")
    with pytest.raises(UsageError, match="unknown key 'stepz'.*'steps'"):
        resolve("--config", str(file))
    file.write_text('[train]\nsteps = "many"\n')
    with pytest.raises(UsageError, match="steps = 'many' should be a int"):
        resolve("--config", str(file))


def test_a_value_outside_its_fields_choices_is_named_from_flags_and_files(tmp_path):
    with pytest.raises(UsageError, match="--lr-schedule 'step' is not one of cosine, linear, "):
        resolve("--lr-schedule", "step")
    file = tmp_path / "c.toml"
    file.write_text('[precision]\nprecision = "fp4"\n')
    with pytest.raises(UsageError, match="--precision 'fp4' is not one of fp32, bf16, fp16, fp8$"):
        resolve("--config", str(file))
    file.write_text("[checkpoint]\nresume = 1\n")  # the former bool's values only
    with pytest.raises(UsageError, match="--resume 1 is not one of auto, required, fresh"):
        resolve("--config", str(file))


def test_the_tables_that_act_on_a_choice_hold_exactly_its_choices():
    from models import family, layers, llama
    from spmd import convert
    from spmd.engine import precision
    from spmd.estimate import cost
    from spmd.sections import PrecisionConfig

    assert set(precision.POLICIES) == set(choices(PrecisionConfig, "precision"))
    assert set(layers.REMAT_POLICIES) == set(choices(llama.LlamaConfig, "remat"))
    assert set(cost.REMATS) == set(choices(llama.LlamaConfig, "remat"))
    assert set(family.EXPORT_DTYPES) == set(choices(convert.ConvertConfig, "hf_dtype"))


MIXTRAL = Path(__file__).resolve().parent / "fixtures" / "hf_mixtral"
PRINTED = {  # flags, and what the printed [model] table holds
    "flags": [
        *("--model", "moe-tiny", "--layout", "megatron", "--n-layers", "3", "--shared-expert"),
        *("--lr-schedule", "wsd", "--lr", "1e-05", "--min-lr-ratio", "0", "--resume"),
        *("--data", 'web=a "b"\\c \u00fc\x7f\t.jsonl:0.5', "--spike-threshold", "inf"),
    ],
    # the folder is the architecture; a router knob given as a flag, then from the file
    "hf": ["--init-from-hf", str(MIXTRAL), "--capacity-factor", "1.25", "--model", "moe-tiny"],
}
PRINTED_MODEL = {"flags": {"n_layers": 3, "shared_expert": True}, "hf": {"capacity_factor": 1.25}}


@pytest.mark.parametrize("case", PRINTED)
def test_print_config_writes_toml_that_config_reads_back_to_the_same_config(tmp_path, capsys, case):
    flags = PRINTED[case]
    assert train.main([*flags, "--print-config"]) == 0
    printed = capsys.readouterr()
    toml = tomllib.loads(printed.out)
    assert printed.err == "" and toml["run"]["model"] == "moe-tiny"
    assert toml["model"].items() >= PRINTED_MODEL[case].items()
    file = tmp_path / "resolved.toml"
    file.write_text(printed.out)

    def resolved(argv: list[str]) -> dict:
        return Config.of(train.resolve_sections(argv)).as_dict()

    assert resolved(["--config", str(file)]) == resolved(flags)
    assert train.main(["--config", str(file), "--print-config"]) == 0
    assert capsys.readouterr().out == printed.out  # printing the printed config changes nothing


def test_batches_depend_on_seed_and_step_only_and_cover_an_epoch_once():
    n_train, batch = 100, 8
    epoch = np.concatenate([data.train_window_ids(3, t, batch, n_train) for t in range(12)])
    assert len(np.unique(epoch)) == len(epoch) == 96  # 4 windows left over this epoch
    again = data.train_window_ids(3, 5, batch, n_train)
    np.testing.assert_array_equal(again, epoch[40:48])
    next_epoch = np.concatenate(
        [data.train_window_ids(3, t, batch, n_train) for t in range(12, 24)]
    )
    assert not np.array_equal(next_epoch, epoch)
    assert not np.array_equal(data.train_window_ids(4, 5, batch, n_train), again)


def test_dcn_split_puts_data_parallel_ways_across_hosts_and_tensor_last(capsys):
    from spmd.parallel.mesh import dcn_split

    assert dcn_split(parse_mesh("dp=2,fsdp=2,tp=2"), 2)["data"] == 2
    assert dcn_split(parse_mesh("fsdp=4,tp=2"), 2)["fsdp"] == 2
    assert dcn_split(parse_mesh("dp=2,tp=4"), 2, "tp=2", devices_per_host=4)["tensor"] == 2
    assert "tensor=4 crosses hosts" in capsys.readouterr().err
    with pytest.raises(UsageError, match="cannot be split over 2 processes"):
        dcn_split(parse_mesh("dp=3"), 2)
    with pytest.raises(UsageError, match="multiply to 4, but there are 2 processes"):
        dcn_split(parse_mesh("dp=2,tp=2"), 2, "dp=2,tp=2")
    with pytest.raises(UsageError, match="tensor=4 must divide tensor=2"):
        dcn_split(parse_mesh("dp=2,tp=2"), 4, "tp=4")


def test_a_config_file_is_read_with_a_bound_and_a_device_is_refused(tmp_path, capsys):
    """--config /dev/zero once read for ever; a file longer than the bound is refused unread,
    even when it is valid TOML (here one long comment)."""
    with pytest.raises(UsageError, match="--config /dev/zero is a device, not a file"):
        resolve("--config", "/dev/zero")
    long = tmp_path / "long.toml"
    long.write_text("#" * config.TOML_LIMIT_BYTES + "\n")
    assert train.main(["--config", str(long), "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --config {long} is longer than 1 MiB, the most a config file may hold; "
                   "give the run's TOML config"]  # fmt: skip
    long.write_text("#" * (config.TOML_LIMIT_BYTES - 20) + "\n[run]\nsteps = 3\n")
    assert resolve("--config", str(long))["run"].steps == 3  # up to the bound: read


def test_a_run_echoes_what_differs_from_the_defaults_and_where_the_whole_config_is():
    def echo(*flags: str, folder: str | None = None) -> list[str]:
        cfg = Config.of(train.resolve_sections(list(flags)))
        return run_setup.describe_config(cfg, folder).splitlines()

    assert echo("--model", "moe-tiny", "--n-layers", "3", "--lr", "1e-05", folder="runs/x") == [
        "config, what differs from the defaults (the whole config: runs/x/config.toml):",
        "[model] n_layers = 3",  # against the moe-tiny preset's
        '[run] model = "moe-tiny"',
        "[optimizer] lr = 1e-05",
    ]
    assert echo() == [
        "config: every value its default (the whole config: the same command with "
        "--print-config prints it)"
    ]
    hf = echo(*PRINTED["hf"])  # the folder's architecture, against the family's field defaults
    assert hf[1].startswith("[model] ") and "capacity_factor = 1.25" in hf[1], hf
    assert f'init_from_hf = "{MIXTRAL}"' in hf[2], hf
