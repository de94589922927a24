"""``opgraph emit-cpp`` for every built-in op_api with a public aclnn API, on Ascend910B and
Ascend950, every dtype the op_api allows there, its flag options (all off, then each one on by
itself) and levels 1 and 2: the program compiles (g++ -fsyntax-only against the fixture headers),
calls the op's own two-phase entry points with the user tensors in the order of its header's
prototype (NULL optional tensors as ``nullptr``, switched-off masks as ``false``), and copies back
and prints exactly the outputs it writes. A dtype the op_api refuses on a SoC is one CLI line."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import pytest

from cpp_helpers import GXX, INCLUDE, compile_cpp, precompiled_std, run_cli
from family import shipped_op_apis
from opgraph.core.dtypes import DataType
from opgraph.core.opapi import InputConfig, OpApiSpec, Option
from opgraph.core.platform import PRESETS

PLATFORMS = ("Ascend910B", "Ascend950")
LEVELS = (1, 2)
DATA_DTYPES = (DataType.FLOAT, DataType.FLOAT16, DataType.BF16)
# What each flag option means for the op's public prototype (the options' documented effect):
# the tensors it passes as NULL and the bool masks it turns off.
FLAG_EFFECT: dict[str, dict[str, str]] = {
    "no_weight": {"weight": "nullptr"},
    "no_bias": {"bias": "nullptr"},
    "no_running_stats": {"runningMean": "nullptr", "runningVar": "nullptr"},
    "no_input_g": {"inputG": "false", "sumDy": "nullptr", "sumDyXmu": "nullptr"},
    "no_weight_g": {"weightG": "false", "gradWeight": "nullptr"},
    "no_bias_g": {"biasG": "false", "gradBias": "nullptr"},
}
# aclDataType → (the host vector's element type, how a result element is printed)
HOST = {"ACL_FLOAT": ("float", "{h}[i]"), "ACL_FLOAT16": ("uint16_t", "HalfToFloat({h}[i])"),
        "ACL_BF16": ("uint16_t", "BFloat16ToFloat({h}[i])"), "ACL_INT32": ("int32_t", "{h}[i]")}


def builtin_specs() -> list[OpApiSpec]:
    """The op_apis opgraph itself registers (not user plugins) that have a public aclnn API."""
    return [s for s in shipped_op_apis() if s.aclnn_api]


def flags(spec: OpApiSpec) -> list[Option]:
    return [o for o in spec.options if o.type == "flag"]


@dataclass(frozen=True)
class Case:
    """One ``opgraph emit-cpp`` invocation."""

    spec: OpApiSpec
    platform: str
    dtype: DataType
    flag: Optional[Option]
    level: int

    @property
    def id(self) -> str:
        return (f"{self.spec.name}-{self.platform}-{self.dtype.short}-"
                f"{self.flag.name if self.flag else 'defaults'}-O{self.level}")

    @property
    def argv(self) -> list[str]:
        return (["emit-cpp", self.spec.name, "--platform", self.platform, "--dtype", self.dtype.short,
                 "--level", str(self.level)] + ([self.flag.flag] if self.flag else []))

    @property
    def effect(self) -> dict[str, str]:
        return FLAG_EFFECT[self.flag.name] if self.flag else {}


CASES = {c.id: c for c in (Case(s, p, d, f, level) for s in builtin_specs() for p in PLATFORMS
                           if p in s.platforms for d in s.dtypes(PRESETS[p])
                           for f in [None, *flags(s)] for level in LEVELS)}


def test_the_family_and_its_flags_are_covered():
    names = {c.spec.name for c in CASES.values()}
    assert {"aclnnBatchNormElemtBackward", "aclnnBatchNormStats", "aclnnBatchNormReduce",
            "aclnnSyncBatchNormGatherStats"} <= names and len(names) >= 7
    for spec in builtin_specs():  # a new flag needs its effect written down above
        assert {o.name for o in flags(spec)} <= set(FLAG_EFFECT), spec.name


# --- emit and compile every case once --------------------------------------------------------------
@dataclass
class Emitted:
    rc: int
    log: str
    text: str
    error: str = ""  # g++'s stderr ('' = compiled)


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, Emitted]:
    """case id → the emitted program and g++'s verdict; syntax checks on 2 workers."""
    if GXX is None:
        pytest.skip("g++ not installed: cannot compile emitted C++")
    root = tmp_path_factory.mktemp("emit_family")
    out: dict[str, Emitted] = {}
    for cid, case in CASES.items():
        path = root / cid / "prog.cpp"
        path.parent.mkdir()
        rc, log = run_cli([*case.argv, "-o", str(path)])
        out[cid] = Emitted(rc, log, path.read_text() if path.exists() else "")
    pch = precompiled_std(root)
    todo = [cid for cid, e in out.items() if e.rc == 0]
    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = pool.map(lambda cid: compile_cpp(root / cid / "prog.cpp", "-fsyntax-only", *pch), todo)
        for cid, error in zip(todo, errors):
            out[cid].error = error
    return out


@pytest.mark.parametrize("cid", list(CASES))
def test_program_is_written_and_compiles(programs, cid):
    e = programs[cid]
    assert e.rc == 0, e.log
    assert e.log.startswith("wrote ") and "aclnn calls" in e.log, e.log
    assert e.error == "", e.error[-3000:]


# --- the calls ----------------------------------------------------------------------------------
def prototype(api: str, header: str) -> list[tuple[str, str]]:
    """(type, name) of each parameter of ``api``GetWorkspaceSize in fixture header ``header``,
    the common workspaceSize / executor tail dropped."""
    text = (INCLUDE / "aclnnop" / header).read_text()
    m = re.search(rf"\b{api}GetWorkspaceSize\s*\(([^)]*)\)", text)
    assert m, f"{header} declares no {api}GetWorkspaceSize"
    params = [re.fullmatch(r"(.*?)(\w+)", p.strip()).groups() for p in m.group(1).split(",")]
    assert [n for _, n in params[-2:]] == ["workspaceSize", "executor"]
    return [(t.strip(), n) for t, n in params[:-2]]


def calls(text: str) -> list[tuple[str, list[str]]]:
    """(api, phase-1 arguments) of every call, in order; each must be followed by its phase 2."""
    found = re.findall(r"ret = (aclnn\w+)GetWorkspaceSize\((.*)\);\n"
                       r"(?:.*\n)*?    ret = (aclnn\w+)\(workspaceAddr, workspaceSize, executor, stream\);",
                       text)
    assert len(found) == text.count("GetWorkspaceSize(")
    out = []
    for api, args, api2 in found:
        assert api2 == api, f"phase 1 of {api} is followed by phase 2 of {api2}"
        args = args.split(", ")
        assert args[-2:] == ["&workspaceSize", "&executor"], args
        out.append((api, args[:-2]))
    return out


def tensor_line(text: str, name: str) -> str:
    """The aclCreateTensor line of the aclTensor named after parameter ``name``."""
    m = re.search(rf"aclTensor \*t_{name} = aclCreateTensor\(.*", text)
    assert m, f"no aclTensor t_{name}"
    return m.group(0)


def acl_dtype(text: str, name: str) -> str:
    return re.search(r"\.size\(\), (ACL_\w+), ", tensor_line(text, name)).group(1)


def c_number(arg: str) -> float:
    """A C double / float literal's value."""
    assert re.fullmatch(r"-?\d+\.\d*(e[-+]\d+)?f?", arg), arg
    return float(arg.rstrip("f"))


@pytest.mark.parametrize("cid", list(CASES))
def test_whole_op_call_passes_the_user_arguments_in_prototype_order(programs, cid):
    """Level 2 is one call of the op's public API; level 1 is that call too unless every kernel
    has its own aclnn API. Tensors in the header's order, NULL ones as nullptr, masks, scalars."""
    case, text = CASES[cid], programs[cid].text
    spec, plan = case.spec, calls(text)
    assert plan, "no aclnn calls"
    if case.level == 1 and len(plan) > 1:  # lowered kernel by kernel: nothing is passed whole
        assert all(a != "nullptr" for _, args in plan for a in args), plan
        return
    assert [api for api, _ in plan] == [spec.aclnn_api]
    assert f'#include "aclnnop/{spec.aclnn_header}"' in text
    assert f"    ret = {spec.aclnn_api}(workspaceAddr, workspaceSize, executor, stream);" in text
    params, (_, args) = prototype(spec.aclnn_api, spec.aclnn_header), plan[0]
    assert len(args) == len(params), (params, args)
    options = {o.name: o for o in spec.options}
    for (ctype, name), arg in zip(params, args):
        if "aclTensor" in ctype:
            assert arg == case.effect.get(name, f"t_{name}"), (name, arg)
        elif ctype.endswith("bool"):
            assert arg == case.effect.get(name, "true"), (name, arg)
        elif ctype.endswith("double") or ctype.endswith("float"):
            assert arg.endswith("f") == ctype.endswith("float"), (name, ctype, arg)
            value = c_number(arg)
            if name in options:  # the CLI passes the option's default
                want = float(options[name].default)
                assert value == pytest.approx(want, rel=1e-7 if arg.endswith("f") else 1e-15), name
        else:
            pytest.fail(f"{spec.aclnn_api}: parameter {ctype} {name} not checked")
    data = next(n for t, n in params if "aclTensor" in t)  # gradOut / input / x / totalSum
    assert acl_dtype(text, data) == case.dtype.acl_name
    cfg = InputConfig(spec.default_shape, case.dtype, {})
    for name, fmt in spec.formats(cfg).items():  # e.g. BatchNormReduce's NCHW-tagged x
        assert f", ACL_FORMAT_{fmt}, " in tensor_line(text, name), name


# --- results ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cid", list(CASES))
def test_outputs_are_copied_back_and_printed(programs, cid):
    """Every output / in-out tensor that is not NULL — and nothing else — is copied to the host
    after the stream sync and printed as its dtype; NULL tensors have no buffer at all."""
    case, text = CASES[cid], programs[cid].text
    written = [p.name for p in case.spec.tensor_params("output", "inout")]
    nulled = [n for n, v in case.effect.items() if v == "nullptr"]
    assert set(nulled) <= {p.name for p in case.spec.params}
    assert re.findall(r'LOG_PRINT\("(\w+):\\n"\);', text) == [n for n in written if n not in nulled]
    sync = text.index("ret = aclrtSynchronizeStream(stream);")
    for name in written:
        if name in nulled:
            assert not re.search(rf"\b(t|host|dev)_{name}\b", text), name
            continue
        ctype, shown = HOST[acl_dtype(text, name)]
        host = f"host_{name}"
        assert re.search(rf"std::vector<{ctype}> {host}\b", text), name
        copy = text.index(f"ret = aclrtMemcpy({host}.data(), {host}.size() * sizeof({ctype}), "
                          f"dev_{name}, {host}.size() * sizeof({ctype}), ACL_MEMCPY_DEVICE_TO_HOST);")
        value = shown.format(h=host)
        show = text.index(f'LOG_PRINT("result[%zu] is: %.9g\\n", i, static_cast<double>({value}));',
                          copy)
        assert sync < copy < show, name


# --- refused combinations -------------------------------------------------------------------------
REFUSED = [(s, p, d) for s in builtin_specs() for p in PLATFORMS if p in s.platforms
           for d in DATA_DTYPES if d not in s.dtypes(PRESETS[p])]


def test_some_dtype_is_refused_somewhere():
    assert any(s.name == "aclnnBatchNormStats" and p == "Ascend910B" and d == DataType.BF16
               for s, p, d in REFUSED)


@pytest.mark.parametrize("spec,soc,dtype", REFUSED,
                         ids=[f"{s.name}-{p}-{d.short}" for s, p, d in REFUSED])
def test_refused_dtype_is_one_error_line(tmp_path, spec, soc, dtype):
    path = tmp_path / "prog.cpp"
    rc, log = run_cli(["emit-cpp", spec.name, "--platform", soc, "--dtype", dtype.short,
                       "-o", str(path)])
    assert rc != 0 and not path.exists()
    lines = log.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("opgraph: error: "), log
    assert dtype.name in lines[0] and soc in lines[0] and "not supported" in lines[0], log
