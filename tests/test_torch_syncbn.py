"""opgraph.torch.SyncBatchNorm across 2 and 3 gloo processes (uneven batches, a rank with one
sample, a rank with none) against single-process torch batch norm on the concatenated batch
(fp32, within FP32_BOUND) and, bit for bit, against the same primitives chained in one process
by this file (every dtype: the distributed sequence adds nothing but the exchange).

All scenarios of a world size run in ONE ``run_ranks`` session (module fixture) to keep the
processes' start-up out of each test; every process is joined or killed, the session bounded.
"""
from __future__ import annotations

import contextlib
import functools
import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'opgraph[torch]')")

import torch.distributed as dist  # noqa: E402

import opgraph.torch as ot  # noqa: E402
from opgraph.torch import kernels as K  # noqa: E402

# the stated fp32 bound: max |distributed - torch| <= FP32_BOUND * max(1, max |torch|), for the
# output, running mean/var and the input/weight/bias gradients (measured: at most 3.5e-7)
FP32_BOUND = 2e-6
SESSION_TIMEOUT = 90.0
EPS = 1e-5
C = 4

# name: batch size per rank for each world size, input dims after C, dtype, options
SCENARIOS = {
    "fp32": dict(sizes={2: [3, 1], 3: [2, 0, 1]}, dims=(5, 3), dtype="float32"),
    "fp32_channels_last_cumulative": dict(sizes={2: [2, 3], 3: [1, 2, 2]}, dims=(3, 4),
                                          dtype="float32", channels_last=True, momentum=None),
    "fp32_3d_no_affine": dict(sizes={2: [2, 2], 3: [0, 3, 1]}, dims=(6,), dtype="float32",
                              affine=False),
    "fp32_2d_one_value_per_channel": dict(sizes={2: [1, 3], 3: [1, 1, 2]}, dims=(),
                                          dtype="float32"),
    "fp32_no_running_stats": dict(sizes={2: [3, 2], 3: [2, 2, 1]}, dims=(2, 2), dtype="float32",
                                  track=False),
    "fp16": dict(sizes={2: [3, 1], 3: [2, 0, 1]}, dims=(5, 3), dtype="float16"),
    "fp16_half_model": dict(sizes={2: [2, 3], 3: [1, 0, 3]}, dims=(4, 2), dtype="float16",
                            model="float16"),
    "bf16_950": dict(sizes={2: [3, 1], 3: [2, 0, 1]}, dims=(5, 3), dtype="bfloat16",
                     platform="Ascend950"),
    # the 950's gather refuses bf16 running stats: the layer updates float32 copies
    "bf16_950_bf16_model": dict(sizes={2: [2, 3], 3: [1, 0, 3]}, dims=(4, 2), dtype="bfloat16",
                                platform="Ascend950", model="bfloat16"),
    # nor does it go without running stats next to a bf16 input (it makes bf16 zeros): the layer
    # gives it float32 ones and drops their update
    "bf16_950_no_running_stats": dict(sizes={2: [3, 2], 3: [2, 0, 2]}, dims=(3, 2),
                                      dtype="bfloat16", platform="Ascend950", track=False),
}
STEPS = 2
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def case(name: str, world: int) -> dict:
    """The scenario's data for both steps: inputs/grads (whole batch), weight, bias."""
    sc = SCENARIOS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    shape = (sum(sc["sizes"][world]), C, *sc["dims"])
    xs = [torch.randn(*shape, generator=g) * 3 + 1.5 for _ in range(STEPS)]
    dys = [torch.randn(*shape, generator=g) for _ in range(STEPS)]
    dt = DTYPES[sc["dtype"]]
    return dict(sc, xs=[x.to(dt) for x in xs], dys=[d.to(dt) for d in dys],
                weight=torch.rand(C, generator=g) + 0.5, bias=torch.randn(C, generator=g))


def shard(t, sizes, rank):
    lo = sum(sizes[:rank])
    return t[lo:lo + sizes[rank]]


def layout(t, cs):
    return t.contiguous(memory_format=torch.channels_last) if cs.get("channels_last") else t


def make_module(cs):
    bn = ot.SyncBatchNorm(C, momentum=cs.get("momentum", 0.1), affine=cs.get("affine", True),
                          track_running_stats=cs.get("track", True),
                          platform=cs.get("platform"))
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(cs["weight"])
            bn.bias.copy_(cs["bias"])
    return bn.to(DTYPES[cs["model"]]) if "model" in cs else bn


def grads(bn):
    return [None if p is None or p.grad is None else p.grad.clone()
            for p in (bn.weight, bn.bias)]


# --- what each rank runs ---------------------------------------------------------------------
@contextlib.contextmanager
def recording_all_reduce(log: list):
    """Keep a copy of every all_reduce result (the summed [sum_dy, sum_dy_xmu])."""
    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        work = real(tensor, *args, **kwargs)
        log.append(tensor.clone())
        return work

    dist.all_reduce = all_reduce
    try:
        yield log
    finally:
        dist.all_reduce = real


def run_scenarios(rank: int, world: int) -> dict:
    with recording_all_reduce([]) as sums:
        out = {name: run_scenario(name, rank, world, sums) for name in SCENARIOS}
    try:
        ot.SyncBatchNorm(C)(torch.empty(2, C, 3, device="meta"))
    except ValueError as e:
        out["meta_error"] = str(e)
    try:  # float64 on rank 0 only: the others, empty, compute no statistics
        ot.SyncBatchNorm(C).double()(torch.ones(3 if rank == 0 else 0, C, 2, dtype=torch.float64))
    except TypeError as e:
        out["dtype_error"] = str(e)
    return out


def run_scenario(name: str, rank: int, world: int, sums: list) -> dict:
    cs = case(name, world)
    sizes = cs["sizes"][world]
    bn = make_module(cs)
    steps = []
    for x, dy in zip(cs["xs"], cs["dys"]):
        xi = layout(shard(x, sizes, rank), cs).clone().requires_grad_()
        bn.zero_grad()
        y = bn(xi)
        y.backward(layout(shard(dy, sizes, rank), cs))
        steps.append(dict(y=y.detach(), gx=xi.grad, gw_gb=grads(bn), sums=sums.pop(),
                          channels_last=y.is_contiguous(memory_format=torch.channels_last)))
    bn.eval()  # with running stats: plain batch norm on them (without: per-rank batch stats)
    return dict(steps=steps, running=(bn.running_mean, bn.running_var),
                tracked=bn.num_batches_tracked,
                eval_y=bn(shard(cs["xs"][0], sizes, rank)).detach()
                if bn.track_running_stats else None)


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def session(request):
    world = request.param
    return world, ot.run_ranks(run_scenarios, world, timeout=SESSION_TIMEOUT, pg_timeout=30)


# --- references ------------------------------------------------------------------------------
def torch_reference(cs) -> dict:
    """torch.nn.BatchNorm1d/2d/3d (fp32, one process, the whole batch), the same steps."""
    cls = {0: torch.nn.BatchNorm1d, 1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d,
           3: torch.nn.BatchNorm3d}[len(cs["dims"])]
    bn = cls(C, EPS, cs.get("momentum", 0.1), cs.get("affine", True), cs.get("track", True))
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(cs["weight"])
            bn.bias.copy_(cs["bias"])
    steps = []
    for x, dy in zip(cs["xs"], cs["dys"]):
        x = x.float().requires_grad_()
        bn.zero_grad()
        y = bn(x)
        y.backward(dy.float())
        steps.append(dict(y=y.detach(), gx=x.grad, gw_gb=grads(bn)))
    bn.eval()
    return dict(steps=steps, running=(bn.running_mean, bn.running_var),
                tracked=bn.num_batches_tracked,
                eval_y=bn(cs["xs"][0].float()).detach() if bn.track_running_stats else None)


def chained_reference(cs, world: int, gloo_sums=None) -> list[dict]:
    """The primitives chained in this process, rank by rank, with the exchange done by hand:
    rows [mean, invstd, count] stacked in rank order, ranks with count < 1 dropped, the ranks'
    [sum_dy, sum_dy_xmu] added — or, where given, the sums gloo produced (``gloo_sums[step]``:
    with three ranks adding, gloo's order is its own). Per step: the ranks' y, grad_input and
    weight grads, and the sums of every order of addition."""
    sizes = cs["sizes"][world]
    mods = [make_module(cs) for _ in range(world)]
    where = {"platform": cs.get("platform")}
    result = []
    for i, (x, dy) in enumerate(zip(cs["xs"], cs["dys"])):
        xs = [layout(shard(x, sizes, r), cs) for r in range(world)]
        dys = [layout(shard(dy, sizes, r), cs) for r in range(world)]
        rows = []
        for xi in xs:
            if xi.numel():
                m, s = K.batch_norm_stats(xi, EPS, **where)
                rows.append(torch.cat([m, s, torch.tensor([xi.numel() // C], dtype=m.dtype)]))
            else:
                rows.append(torch.zeros(2 * C + 1))
        table = torch.stack(rows)
        table = table[table[:, 2 * C] >= 1]
        step, red = [], []
        for r, (xi, bn) in enumerate(zip(xs, mods)):
            momentum = bn.momentum
            if bn.track_running_stats:
                bn.num_batches_tracked += 1
                momentum = 1 / float(bn.num_batches_tracked) if momentum is None else momentum
            counts = table[:, 2 * C]
            running = [bn.running_mean, bn.running_var]
            if bn.running_mean is not None:
                counts = counts.to(bn.running_mean.dtype)
                if cs.get("platform") == "Ascend950":  # the fused kernel's: mean's dtype
                    running = [t.float() for t in running]
            elif cs.get("platform") == "Ascend950" and xi.dtype != torch.float32:
                running = [torch.zeros(C), torch.ones(C)]  # (their update dropped)
            mean, invstd = K.batch_norm_gather_stats_with_counts(
                xi, table[:, :C], table[:, C:2 * C], *running, momentum, EPS, counts, **where)
            if bn.running_mean is not None:
                bn.running_mean.copy_(running[0])
                bn.running_var.copy_(running[1])
            if xi.numel():
                y = K.batch_norm_elemt(xi, bn.weight, bn.bias, mean, invstd, EPS, **where)
                sdy, sdx, gw, gb = K.batch_norm_backward_reduce(
                    dys[r], xi, mean, invstd, bn.weight, True, bn.affine, bn.affine, **where)
            else:
                y, sdy, sdx, gw, gb = torch.empty_like(xi), torch.zeros(C), torch.zeros(C), None, None
            red.append(torch.cat([sdy, sdx]))
            step.append(dict(y=y, mean=mean, invstd=invstd, gw_gb=[gw, gb],
                             running=(bn.running_mean, bn.running_var)))
        orders = {tuple(p): functools.reduce(torch.add, [red[j] for j in p])
                  for p in itertools.permutations(range(world))}
        total = orders[tuple(range(world))] if gloo_sums is None else gloo_sums[i]
        for r, (xi, bn, st) in enumerate(zip(xs, mods, step)):
            w = bn.weight if bn.weight is None else bn.weight.to(st["mean"].dtype)
            st["gx"] = K.batch_norm_backward_elemt(
                dys[r], xi, st["mean"], st["invstd"], w, total[:C], total[C:],
                table[:, 2 * C:].to(torch.int32), **where) if xi.numel() else None
        result.append(dict(ranks=step, orders=orders))
    return result


def cat_ranks(results, name, step, key):
    return torch.cat([r[name]["steps"][step][key] for r in results])


def summed(tensors):
    present = [t for t in tensors if t is not None]
    total = present[0].double()
    for t in present[1:]:
        total = total + t.double()
    return total


def bits(t):
    t = t.detach().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()


def within(got, want, what):
    got, want = got.double(), want.double()
    err = float((got - want).abs().max()) if want.numel() else 0.0
    bound = FP32_BOUND * max(1.0, float(want.abs().max()) if want.numel() else 0.0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > bound {bound:.3g}"


# --- the tests -------------------------------------------------------------------------------
FP32 = [n for n, sc in SCENARIOS.items() if sc["dtype"] == "float32"]


@pytest.mark.parametrize("name", FP32)
def test_fp32_matches_single_process_batch_norm(session, name):
    world, results = session
    cs = case(name, world)
    ref = torch_reference(cs)
    for step in range(STEPS):
        within(cat_ranks(results, name, step, "y"), ref["steps"][step]["y"], f"step {step} output")
        gx = [r[name]["steps"][step]["gx"] for r in results]
        sizes = cs["sizes"][world]
        assert [g is None for g in gx] == [n == 0 for n in sizes]  # an empty rank: no gradient
        within(torch.cat([g for g in gx if g is not None]), ref["steps"][step]["gx"],
               f"step {step} grad_input")
        for i, what in enumerate(("grad_weight", "grad_bias")):
            want = ref["steps"][step]["gw_gb"][i]
            got = [r[name]["steps"][step]["gw_gb"][i] for r in results]
            if want is None:
                assert all(g is None for g in got)
            else:  # summed over the ranks, as DDP's all_reduce would
                within(summed(got), want, f"step {step} {what}")
    for r in results:
        for got, want, what in zip(r[name]["running"], ref["running"], ("mean", "var")):
            if want is None:
                assert got is None
            else:
                within(got, want, f"running_{what}")
        assert r[name]["tracked"] == ref["tracked"]
    if ref["eval_y"] is not None:
        within(torch.cat([r[name]["eval_y"] for r in results]), ref["eval_y"], "eval output")


@pytest.mark.parametrize("name", [n for n, sc in SCENARIOS.items() if "model" in sc])
def test_a_half_precision_models_running_stats_follow_the_float32_update(session, name):
    """fp16/bf16 running stats against torch's float32 batch norm on the same (half-valued)
    data: each step's update rounded once to the model's dtype, so within two roundings of it
    (2^-7 of the largest value covers bf16's; a skipped update or an unbiased/biased mix-up of
    the variance is far outside)."""
    world, results = session
    cs = case(name, world)
    ref = torch_reference(cs)
    for r in results:
        for got, want, what in zip(r[name]["running"], ref["running"], ("mean", "var")):
            assert got.dtype == DTYPES[cs["model"]]
            err = float((got.double() - want.double()).abs().max())
            bound = 2.0 ** -7 * float(want.abs().max())
            assert err <= bound, f"running_{what}: max abs error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bits_equal_the_primitives_chained_in_one_process(session, name):
    world, results = session
    cs = case(name, world)
    gloo = [results[0][name]["steps"][i]["sums"] for i in range(STEPS)]
    chain = chained_reference(cs, world, gloo_sums=gloo)
    for step in range(STEPS):
        for r, res in enumerate(results):
            got, want = res[name]["steps"][step], chain[step]["ranks"][r]
            assert got["y"].dtype == DTYPES[cs["dtype"]]
            assert np.array_equal(bits(got["y"]), bits(want["y"])), f"rank {r} step {step} y"
            if want["gx"] is None:
                assert got["gx"] is None
            else:
                assert np.array_equal(bits(got["gx"]), bits(want["gx"])), f"rank {r} grad_input"
            for g, w in zip(got["gw_gb"], want["gw_gb"]):
                assert (g is None) == (w is None)
                if g is not None:
                    assert np.array_equal(bits(g), bits(w.to(g.dtype))), f"rank {r} weight grads"
    for r, res in enumerate(results):  # after the last step (the chain's modules are updated)
        for g, w in zip(res[name]["running"], chain[-1]["ranks"][r]["running"]):
            assert (g is None) == (w is None)
            if g is not None:
                assert g.dtype == w.dtype == DTYPES[cs.get("model", "float32")]
                assert np.array_equal(bits(g), bits(w)), f"rank {r} running stats"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_all_reduce_adds_the_ranks_sums(session, name):
    """What gloo returned is the same on every rank and, element by element, the ranks'
    [sum_dy, sum_dy_xmu] added in one of the possible orders (with two ranks: exactly a + b)."""
    world, results = session
    chain = chained_reference(case(name, world), world)
    for step in range(STEPS):
        got = results[0][name]["steps"][step]["sums"]
        for r in results[1:]:
            assert np.array_equal(bits(r[name]["steps"][step]["sums"]), bits(got))
        some_order = torch.zeros(got.shape, dtype=torch.bool)
        for total in chain[step]["orders"].values():
            some_order |= torch.from_numpy(bits(total) == bits(got))
        assert bool(some_order.all()), f"step {step}: not a sum of the ranks' values"


def test_channels_last_stays_channels_last(session):
    _, results = session
    for r in results:
        steps = r["fp32_channels_last_cumulative"]["steps"]
        assert all(s["channels_last"] for s in steps if s["y"].numel())


def test_ranks_agree_on_running_stats_and_batches_tracked(session):
    _, results = session
    for name in SCENARIOS:
        first = results[0][name]
        for r in results[1:]:
            tracked = SCENARIOS[name].get("track", True)
            assert r[name]["tracked"] == first["tracked"] == (STEPS if tracked else None)
            for a, b in zip(r[name]["running"], first["running"]):
                assert (a is None and b is None) or np.array_equal(bits(a), bits(b))


def test_an_unsupported_dtype_is_refused_alike_on_every_rank_an_empty_one_too(session):
    """Before any exchange: the empty ranks, which compute no statistics, waited in the gather
    for a rank that had failed in BatchNormStats (then gloo's 'Connection closed by peer')."""
    _, results = session
    assert all("input dtype torch.float64 is not supported on Ascend910B" in r["dtype_error"]
               and "use float32" in r["dtype_error"] for r in results)


def test_a_non_cpu_input_is_a_clear_error(session):
    _, results = session
    assert all("runs on CPU tensors" in r["meta_error"] and "meta" in r["meta_error"]
               for r in results)
