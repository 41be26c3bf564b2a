"""Tests for spmd.estimate.hlo: collectives and memory read from compiled HLO (8 CPU devices
assumed)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.estimate import hlo, hlo_text


def _mesh(shape=(2, 4), names=("data", "tensor")):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _compile_shard_map(f, mesh, in_spec, out_spec, x):
    g = jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=True)
    return jax.jit(g).lower(x).compile()


X = jnp.ones((8, 16), jnp.float32)  # local shard under P("data", "tensor"): (4, 4) f32 = 64 B


def test_psum_over_data_is_one_all_reduce():
    mesh = _mesh()
    compiled = _compile_shard_map(
        lambda a: lax.psum(a, "data"), mesh, P("data", "tensor"), P(None, "tensor"), X
    )
    colls = hlo.collectives(compiled, mesh)
    assert len(colls) == 1
    (c,) = colls
    assert (c.kind, c.axes, c.bytes, c.count, c.dtype) == ("all-reduce", ("data",), 64, 1, "f32")
    assert hlo.collectives(compiled)[0].axes == ()


def test_psum_over_two_axes():
    mesh = _mesh()
    compiled = _compile_shard_map(
        lambda a: lax.psum(a, ("data", "tensor")), mesh, P("data", "tensor"), P(), X
    )
    (c,) = hlo.collectives(compiled, mesh)
    assert c.axes == ("data", "tensor")


def _scan_psum(length):
    def body(carry, _):
        return carry + 0.5 * lax.psum(carry, "data"), None

    return lambda a: lax.scan(body, a, None, length=length)[0]


def test_scan_multiplies_count():
    mesh = _mesh()
    spec = P("data", "tensor")
    compiled = _compile_shard_map(_scan_psum(5), mesh, spec, spec, X)
    (c,) = hlo.collectives(compiled, mesh)
    assert (c.kind, c.count, c.axes, c.bytes) == ("all-reduce", 5, ("data",), 64)
    summary = hlo.collective_summary([c])
    assert summary == {"all-reduce": {"count": 5, "bytes": 320, "axes": ["data"]}}


def test_nested_scan_multiplies_counts():
    mesh = _mesh()
    spec = P("data", "tensor")
    inner = _scan_psum(5)

    def f(a):
        return lax.scan(lambda carry, _: (inner(carry), None), a, None, length=3)[0]

    (c,) = hlo.collectives(_compile_shard_map(f, mesh, spec, spec, X), mesh)
    assert (c.kind, c.count) == ("all-reduce", 15)


def test_all_gather_tiled():
    mesh = _mesh()
    spec = P("data", "tensor")
    compiled = _compile_shard_map(
        lambda a: lax.all_gather(a, "tensor", axis=1, tiled=True), mesh, spec, spec, X
    )
    (c,) = hlo.collectives(compiled, mesh)
    assert (c.kind, c.axes, c.bytes) == ("all-gather", ("tensor",), 4 * 16 * 4)


def test_psum_scatter_is_reduce_scatter():
    mesh = _mesh()
    spec = P("data", "tensor")
    compiled = _compile_shard_map(
        lambda a: lax.psum_scatter(a, "tensor", scatter_dimension=1, tiled=True),
        mesh,
        spec,
        spec,
        X,
    )
    (c,) = hlo.collectives(compiled, mesh)
    assert (c.kind, c.axes, c.bytes) == ("reduce-scatter", ("tensor",), 4 * 1 * 4)


def test_ppermute_is_collective_permute():
    mesh = _mesh()
    spec = P("data", "tensor")
    compiled = _compile_shard_map(
        lambda a: lax.ppermute(a, "tensor", [(i, (i + 1) % 4) for i in range(4)]),
        mesh,
        spec,
        spec,
        X,
    )
    (c,) = hlo.collectives(compiled, mesh)
    assert (c.kind, c.axes, c.bytes) == ("collective-permute", ("tensor",), 64)


def test_all_to_all():
    mesh = _mesh()
    spec = P("data", "tensor")
    compiled = _compile_shard_map(
        lambda a: lax.all_to_all(a, "tensor", 0, 1, tiled=True),
        mesh,
        spec,
        spec,
        jnp.ones((16, 16)),
    )
    (c,) = hlo.collectives(compiled, mesh)
    assert (c.kind, c.axes, c.bytes) == ("all-to-all", ("tensor",), 8 * 4 * 4)


def test_auto_sharded_reductions_map_to_mesh_axes():
    # XLA prints these groups in its compact mesh-axes / iota forms; check the axes decoded.
    mesh = _mesh((2, 2, 2), ("a", "b", "c"))
    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P(("a", "c"), "b")))
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))
    axes = {c.axes for c in hlo.collectives(total.lower(x).compile(), mesh)}
    assert axes == {("b",), ("a", "c")}
    gather = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P("a", None)))
    colls = hlo.collectives(gather.lower(x).compile(), mesh)
    assert {(c.kind, c.axes) for c in colls} == {("all-gather", ("b",)), ("all-gather", ("c",))}


def test_memory_argument_bytes_match_shards():
    mesh = _mesh()
    x = jax.device_put(X, NamedSharding(mesh, P("data", "tensor")))
    w = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("tensor", None)))
    compiled = jax.jit(lambda a, b: a @ b).lower(x, w).compile()
    mem = hlo.memory(compiled)
    shard_bytes = x.addressable_shards[0].data.nbytes + w.addressable_shards[0].data.nbytes
    assert mem["argument"] == shard_bytes == 64 + 512
    assert mem["peak_estimate"] == mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
    report = hlo.format_report(hlo.collective_summary(hlo.collectives(compiled, mesh)), mem)
    assert "all-reduce" in report and "argument" in report and "peak_estimate" in report


# What GPU HLO looks like: async collectives, iota groups, loops with and without trip counts.
SYNTHETIC = """HloModule synthetic, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%rs_wrapped (x: f32[64]) -> f32[16] {
  %x = f32[64]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(%x), channel_id=5,
      replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
}

%inner (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %x = f32[16]{0} get-tuple-element(%p), index=1
  %ags = (f32[16]{0}, f32[64]{0}) all-gather-start(%x), channel_id=1, replica_groups=[2,4]<=[8]
  %agd = f32[64]{0} all-gather-done(%ags)
  %ars = bf16[8,2]{1,0} all-reduce-start(%y), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0)
  %ard = bf16[8,2]{1,0} all-reduce-done(%ars)
  %cps = (f32[16], f32[16], u32[], u32[]) collective-permute-start(%x), channel_id=3,
      source_target_pairs={{0,1},{1,0}}
  %cpd = f32[16]{0} collective-permute-done(%cps)
  %trivial = f32[16]{0} all-reduce(%x), channel_id=4, replica_groups={{0},{1},{2},{3}}
  ROOT %t = (s32[], f32[16]{0}) tuple(%i, %x)
}

%cond (p: (s32[], f32[16])) -> pred[] {
  %p = (s32[], f32[16]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  ROOT %w = (s32[], f32[16]{0}) while(%p), condition=%cond, body=%inner,
      backend_config={"known_trip_count":{"n":"4"}}
}

%unknown (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %ar = f32[4,4]{1,0} all-reduce(%q), channel_id=6,
      replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1':(2)2}, to_apply=%add
  ROOT %t = (s32[], f32[16]{0}) tuple(%i, %x)
}

ENTRY %main (p: (s32[], f32[16])) -> f32[16] {
  %p = (s32[], f32[16]{0}) parameter(0)
  %w = (s32[], f32[16]{0}) while(%p), condition=%cond, body=%outer,
      backend_config={"known_trip_count":{"n":"3"}}
  %w2 = (s32[], f32[16]{0}) while(%p), condition=%cond, body=%unknown
  %rs-start = ((f32[64]{0}), f32[16]{0}, u32[]) async-start(%z), calls=%rs_wrapped
  ROOT %rs-done = f32[16]{0} async-done(%rs-start), calls=%rs_wrapped
}
""".replace(",\n      ", ", ")  # real HLO has one instruction per line


def test_synthetic_async_iota_and_loops():
    mesh = _mesh()
    got = {c.name: c for c in hlo.collectives(SYNTHETIC, mesh)}
    assert set(got) == {"ags", "ars", "cps", "ar", "rs"}  # trivial and -done ops skipped
    assert got["ags"] == hlo.Collective("all-gather", 256, 12, ("tensor",), "f32", "ags")
    assert got["ars"] == hlo.Collective("all-reduce", 32, 12, ("data",), "bf16", "ars")
    assert got["cps"] == hlo.Collective("collective-permute", 64, 12, ("tensor",), "f32", "cps")
    assert got["ar"] == hlo.Collective("all-reduce", 64, 1, ("tensor",), "f32", "ar")
    assert got["rs"] == hlo.Collective("reduce-scatter", 64, 1, ("tensor",), "f32", "rs")
    summary = hlo.collective_summary(list(got.values()))
    assert summary["all-reduce"] == {"count": 13, "bytes": 32 * 12 + 64, "axes": ["data", "tensor"]}


def test_mesh_axes_groups_with_device_ids():
    # Printed by XLA for a sum over the rows of an array sharded P("tensor", "data").
    groups = hlo_text.replica_groups(
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0))"
        " {'axis_0'}, use_global_device_ids=true",
        8,
    )
    assert sorted(map(sorted, groups)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    iota = hlo_text.replica_groups("replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={1}", 8)
    assert iota == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert np.array(hlo_text.replica_groups("replica_groups={}, channel_id=1", 8)).size == 8


def test_memory_omits_missing_fields():
    class Stats:
        argument_size_in_bytes = 10
        output_size_in_bytes = None
        temp_size_in_bytes = 5

    class Fake:
        def memory_analysis(self):
            return Stats()

    assert hlo.memory(Fake()) == {"argument": 10, "temp": 5}


def test_dot_dtypes_compiled_lowered_and_text():
    a = jnp.ones((4, 8), jnp.bfloat16)
    b = jnp.ones((8, 2), jnp.bfloat16)
    mixed = jax.jit(lambda x, y: (x @ y, x.astype(jnp.float32) @ y.astype(jnp.float32)))
    lowered = mixed.lower(a, b)
    assert sorted(hlo.dot_dtypes(lowered)) == [
        ("bf16", ("bf16", "bf16")),
        ("f32", ("f32", "f32")),
    ]
    # XLA:CPU upcasts bf16 dots to f32 when it compiles (a GPU keeps them bf16).
    compiled = hlo.dot_dtypes(lowered.compile())
    assert compiled and {ops for _, ops in compiled} <= {("f32", "f32"), ("bf16", "bf16")}
    typed = "ENTRY %e (p: f32[2,2]) -> f32[2,2] {\n  %d = f32[2,2]{1,0} dot(f16[2,2]{1,0} %p, "
    typed += "f16[2,2]{1,0} %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n}\n"
    assert hlo.dot_dtypes(typed) == [("f32", ("f16", "f16"))]
