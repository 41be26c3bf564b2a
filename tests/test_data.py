"""The data pipeline: exactly-once epochs over any number of data shards, reshuffled epochs,
the same step-t batch on every mesh, the token cache, Hugging Face tokenizers, the data state."""

import json
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from spmd.errors import UsageError
from spmd.io import data, tokens
from spmd.parallel import mesh

SEQ_LEN = 8
BATCH = 8


def numbered_windows(n_windows: int) -> data.TokenWindows:
    """Windows whose first input token is window_id * SEQ_LEN: the id can be read back."""
    return data.TokenWindows(np.arange(n_windows * SEQ_LEN + 1), SEQ_LEN, eval_fraction=0.0)


def batch_sharding(spec: str) -> NamedSharding:
    built = mesh.build_mesh(mesh.parse_mesh(spec))
    axes = tuple(a for a in mesh.BATCH_AXES if built.shape[a] > 1)
    return NamedSharding(built, PartitionSpec(axes or None, None))


def ids_per_data_shard(array: jax.Array) -> dict[int, np.ndarray]:
    """Window ids held by each distinct data shard (keyed by its first global row)."""
    shards = {}
    for shard in array.addressable_shards:
        rows = shard.index[0]
        shards[rows.start or 0] = np.asarray(shard.data)[:, 0] // SEQ_LEN
    return shards


@pytest.mark.parametrize("spec, n_shards", [("dp=2,tp=4", 2), ("fsdp=4,tp=2", 4)])
def test_epoch_visits_each_window_once_across_data_shards(spec, n_shards):
    windows = numbered_windows(103)  # 12 steps of 8 per epoch; 7 windows left over
    sharding = batch_sharding(spec)
    seen = []
    for step in range(windows.n_train // BATCH):
        ids = data.train_window_ids(seed=3, step=step, global_batch=BATCH, n_train=windows.n_train)
        shards = ids_per_data_shard(data.global_batch(windows, ids, sharding)["inputs"])
        assert len(shards) == n_shards
        assert all(len(rows) == BATCH // n_shards for rows in shards.values())
        seen.extend(np.concatenate(list(shards.values())))
    counts = np.bincount(seen, minlength=windows.n_train)
    assert len(seen) == 96 and counts.max() == 1


def test_next_epoch_reshuffles():
    n_train = 64
    epoch = [data.train_window_ids(0, s, BATCH, n_train) for s in range(8)]
    following = [data.train_window_ids(0, s, BATCH, n_train) for s in range(8, 16)]
    assert sorted(np.concatenate(epoch)) == sorted(np.concatenate(following)) == list(range(64))
    assert not np.array_equal(np.concatenate(epoch), np.concatenate(following))


def test_step_batch_is_the_same_on_every_mesh():
    windows = numbered_windows(200)
    ids = data.train_window_ids(seed=1, step=30, global_batch=BATCH, n_train=windows.n_train)
    expected = windows.rows(ids)
    for spec in ("dp=1", "dp=8", "dp=2,tp=4", "dp=2,fsdp=2,tp=2", "fsdp=8"):
        devices = 1 if spec == "dp=1" else 8
        built = mesh.build_mesh(mesh.parse_mesh(spec), jax.devices()[:devices])
        axes = tuple(a for a in mesh.BATCH_AXES if built.shape[a] > 1)
        sharding = NamedSharding(built, PartitionSpec(axes or None, None))
        batch = data.global_batch(windows, ids, sharding)
        assert batch["inputs"].sharding == sharding
        np.testing.assert_array_equal(np.asarray(batch["inputs"]), expected[:, :-1])
        np.testing.assert_array_equal(np.asarray(batch["targets"]), expected[:, 1:])


def test_process_reads_the_rows_of_its_devices():
    sharding = batch_sharding("dp=2,fsdp=2,tp=2")
    # One process holds all 8 devices: 4 data shards of 4 rows, each replicated over tp=2.
    assert data.process_row_ranges(sharding, (16, SEQ_LEN)) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    replicated = NamedSharding(sharding.mesh, PartitionSpec())
    assert data.process_row_ranges(replicated, (16, SEQ_LEN)) == [(0, 16)]


def test_resume_refuses_another_data_order():
    saved = data.data_state(10, seed=0, batch=16, seq_len=64, eval_fraction=0.0, fingerprint="a")
    data.check_same_order(saved, {**saved, "step": 0})
    with pytest.raises(UsageError, match="--batch 32 differs from the checkpoint's 16"):
        data.check_same_order(saved, {**saved, "batch": 32})
    with pytest.raises(UsageError, match="the data differs"):
        data.check_same_order(saved, {**saved, "fingerprint": "b"})


def corpus(tmp_path: Path) -> Path:
    text = "".join(
        p.read_text() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:3]
    )
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


def test_text_is_tokenized_once_and_memory_mapped(tmp_path):
    source = corpus(tmp_path)
    cache = tmp_path / "cache"
    first = tokens.open_tokens(str(source), cache_dir=str(cache))
    assert first.path.parent == cache and first.dtype == "uint16"
    loaded = first.load()
    assert isinstance(loaded, np.memmap)
    expected = np.frombuffer(source.read_bytes() + b"\0", np.uint8)
    np.testing.assert_array_equal(loaded, expected)
    written = first.path.stat().st_mtime_ns
    second = tokens.open_tokens(str(source), cache_dir=str(cache))
    assert second == first and first.path.stat().st_mtime_ns == written  # a cache hit
    as_bin = tokens.open_tokens(str(first.path), cache_dir=str(cache))  # --data tokens-*.bin
    assert (as_bin.fingerprint, as_bin.n_tokens) == (first.fingerprint, first.n_tokens)
    source.write_text(source.read_text() + "one more line\n")
    edited = tokens.open_tokens(str(source), cache_dir=str(cache))
    assert edited.path != first.path and edited.fingerprint != first.fingerprint


def test_hugging_face_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    source = corpus(tmp_path)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"])
    bpe.train([str(source)], trainer)
    tokenizer_path = tmp_path / "tokenizer.json"
    bpe.save(str(tokenizer_path))

    token_file = tokens.open_tokens(str(source), str(tokenizer_path), str(tmp_path / "cache"))
    ids = token_file.load()
    expected = bpe.encode(source.read_text()).ids + [bpe.token_to_id("<|endoftext|>")]
    assert len(ids) < len(source.read_bytes()) / 2  # subwords, not bytes
    np.testing.assert_array_equal(ids, expected)
    info = json.loads(token_file.path.with_suffix(".json").read_text())
    assert info["max_id"] == token_file.max_id < 600
    tokens.check_vocab(token_file, 600)
    with pytest.raises(UsageError, match=f"pass --vocab-size {token_file.max_id + 1}"):
        tokens.check_vocab(token_file, 256)


def test_bad_data_inputs_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        tokens.open_tokens(str(tmp_path / "missing.txt"), cache_dir=str(tmp_path))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(UsageError, match="not a whole number of uint16"):
        tokens.open_tokens(str(tmp_path / "odd.bin"), cache_dir=str(tmp_path))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match="not a tokenizers JSON"):
        tokens.open_tokens(str(corpus(tmp_path)), str(tmp_path / "bad.json"), str(tmp_path))


def mixture_of(sizes: dict[str, int], weights: list[float], batch: int = BATCH):
    """A mixture of numbered sources; source i's tokens are offset by 10_000 x i, so a row's
    first input token names its source and window."""
    from spmd.io import mixture

    sources = [
        data.TokenWindows(np.arange(n * SEQ_LEN + 1) + 10_000 * i, SEQ_LEN, eval_fraction=0.0)
        for i, n in enumerate(sizes.values())
    ]
    return mixture.Mixture(list(sizes), sources, weights, batch)


def test_mixture_rows_follow_the_weights_and_each_source_epoch_is_exactly_once():
    from spmd.io import mixture

    mix = mixture_of({"web": 30, "code": 14}, [0.7, 0.3])
    assert mix.rows == [6, 2] and mix.describe().startswith("web 6/8 rows (weight 0.7)")
    assert mixture.rows_per_step([0.5, 0.3, 0.2], 10, ["a", "b", "c"]) == [5, 3, 2]
    with pytest.raises(UsageError, match="--batch 4 leaves no row for source c"):
        mixture.rows_per_step([0.7, 0.25, 0.05], 4, ["a", "b", "c"])
    draws = {0: [], 1: []}
    for step in range(35):  # 7 epochs of web (6 x 35 = 7 x 30), 5 of code (2 x 35 = 5 x 14)
        sources, ids = mix.step_rows(seed=4, step=step)
        assert np.bincount(sources, minlength=2).tolist() == [6, 2]
        for source in (0, 1):
            draws[source].extend(ids[sources == source])
        if step + 1 == 5:  # web's first epoch is complete: each of its windows exactly once
            assert sorted(draws[0]) == list(range(30))
        if step + 1 == 7:
            assert sorted(draws[1]) == list(range(14))
    assert np.bincount(draws[0]).tolist() == [7] * 30
    assert np.bincount(draws[1]).tolist() == [5] * 14
    assert mix.source_tokens(35) == {"web": 35 * 6 * SEQ_LEN, "code": 35 * 2 * SEQ_LEN}
    again = mixture_of({"web": 30, "code": 14}, [0.7, 0.3])
    np.testing.assert_array_equal(again.step_rows(4, 9)[1], mix.step_rows(4, 9)[1])


def test_mixture_step_batch_is_the_same_on_every_mesh():
    mix = mixture_of({"web": 30, "code": 14}, [0.7, 0.3])
    sources, ids = mix.step_rows(seed=2, step=11)
    expected = ids * SEQ_LEN + 10_000 * sources
    for spec in ("dp=1", "dp=8", "dp=2,tp=4", "fsdp=8"):
        devices = 1 if spec == "dp=1" else 8
        built = mesh.build_mesh(mesh.parse_mesh(spec), jax.devices()[:devices])
        axes = tuple(a for a in mesh.BATCH_AXES if built.shape[a] > 1)
        sharding = NamedSharding(built, PartitionSpec(axes or None, None))
        batch = mix.batch_at(2, 11, BATCH, sharding)
        np.testing.assert_array_equal(np.asarray(batch["inputs"])[:, 0], expected)
        np.testing.assert_array_equal(np.asarray(batch["targets"])[:, 0], expected + 1)


def test_mixture_flag_parsing():
    from spmd.io import mixture

    text = "web=data/a/*.parquet:0.7,code=data/b:0.3"
    assert mixture.is_mixture(text) and not mixture.is_mixture("data/a.jsonl")
    assert mixture.parse_sources(text) == [
        ("web", "data/a/*.parquet", pytest.approx(0.7)),
        ("code", "data/b", pytest.approx(0.3)),
    ]
    with pytest.raises(UsageError, match="give a positive weight"):
        mixture.parse_sources("web=a.jsonl,code=b.jsonl:1")
    with pytest.raises(UsageError, match="repeat"):
        mixture.parse_sources("web=a.jsonl:1,web=b.jsonl:1")
