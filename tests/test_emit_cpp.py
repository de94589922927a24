"""``opgraph emit-cpp`` programs compile for every dtype / weight / counter / gradInput dtype /
level / platform variant; their literals and their f16 / bf16 result printing are exact (checked
by g++ and the CPU stub library); the fixture headers they compile against declare the public
prototypes documented in the reference sheet (/work/shared/reference/aclnn-api.md §1.1, §3.1, §4,
§5.1)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from backends.aclnn.emit_cpp import HEADERS, PRELUDE, emit_cpp, literal
from backends.aclnn.plan import CallPlan, TensorDesc, UserBuffer
from cpp_helpers import FIXTURES, GXX, INCLUDE, compile_cpp, needs_gxx, precompiled_std, run_cli
from opgraph.core.dtypes import DataType, dtype_of
from opgraph.core.opapi import op_api_specs

BNEB = "aclnnBatchNormElemtBackward"


# --- every CLI variant compiles ------------------------------------------------------------------
def variants() -> dict[str, list[str]]:
    """CLI argument lists: the defaults, then per level dtype × weight (no-weight ones on
    Ascend950 with small inputs in .bin files), counter dtypes and gradInput dtypes."""
    out: dict[str, list[str]] = {"defaults": []}
    for level in (0, 1, 2):
        base = ["--shape", "2,3,4,5", "--level", str(level)]
        for dtype in ("float32", "float16", "bfloat16"):
            out[f"O{level}-{dtype}"] = base + ["--dtype", dtype]
            out[f"O{level}-{dtype}-no-weight-950"] = base + [
                "--dtype", dtype, "--no-weight", "--platform", "Ascend950", "--embed-limit", "40"]
        for dtype, counter in (("float16", "float16"), ("bfloat16", "int32")):
            out[f"O{level}-{dtype}-counter-{counter}"] = base + [
                "--dtype", dtype, "--counter-dtype", counter]
        for dtype, grad in (("float32", "bfloat16"), ("float16", "float32"), ("bfloat16", "float16")):
            out[f"O{level}-{dtype}-gradInput-{grad}"] = base + [
                "--dtype", dtype, "--grad-input-dtype", grad]
    return out


VARIANTS = variants()


def grad_input_dtype(argv: list[str]) -> str:
    for flag in ("--grad-input-dtype", "--dtype"):
        if flag in argv:
            return argv[argv.index(flag) + 1]
    return "float32"  # the CLI default


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """variant → (program text, '' if it compiled else the reason), compiled in parallel."""
    if GXX is None:
        pytest.skip("g++ not installed: cannot compile emitted C++")
    root = tmp_path_factory.mktemp("emit_cpp")
    texts, failures = {}, {}
    for name, argv in VARIANTS.items():
        path = root / name / "prog.cpp"
        path.parent.mkdir()
        rc, log = run_cli(["emit-cpp", BNEB, *argv, "-o", str(path)])
        if rc != 0:
            failures[name] = f"emit-cpp exited {rc}: {log.strip()}"
        texts[name] = path.read_text() if path.exists() else ""
    todo = [n for n in VARIANTS if n not in failures]
    pch = precompiled_std(root)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 2)) as pool:
        errors = pool.map(lambda n: compile_cpp(root / n / "prog.cpp", "-fsyntax-only", *pch), todo)
        failures.update((n, e) for n, e in zip(todo, errors) if e)
    return {n: (texts[n], failures.get(n, "")) for n in VARIANTS}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_emitted_program_compiles(programs, name):
    text, error = programs[name]
    assert error == "", error
    expr = {"float32": "host_gradInput[i]", "float16": "HalfToFloat(host_gradInput[i])",
            "bfloat16": "BFloat16ToFloat(host_gradInput[i])"}[grad_input_dtype(VARIANTS[name])]
    assert f'LOG_PRINT("result[%zu] is: %.9g\\n", i, static_cast<double>({expr}));' in text


def test_whole_float_counter_is_a_float_literal(programs):
    text, _ = programs["defaults"]  # float32 counter holding whole values (1..8)
    line = next(s for s in text.splitlines() if "std::vector<float> host_counter = {" in s)
    values = line.split("{", 1)[1].rstrip("};").split(", ")
    assert values and all(re.fullmatch(r"\d\.0f", v) for v in values), line


# --- literals are exact -------------------------------------------------------------------------
F32_BITS = [0x41000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
            0x3DCCCCCD, 0x4B800001, 0x4F000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
            0x7FC00001, 0x7FA00000, 0xFFFFFFFF]
F64_BITS = [0x4020000000000000, 0x8000000000000000, 0x0000000000000001, 0x7FEFFFFFFFFFFFFF,
            0x3FB999999999999A, 0x4340000000000001, 0x7FF0000000000000, 0xFFF0000000000000,
            0x7FF8000000000000, 0xFFF8000000000001, 0x7FF4000000000000]
INTS = {"int32_t": [-2**31, 2**31 - 1, 0, -1], "int64_t": [-2**63, 2**63 - 1, -2**31 - 1],
        "int8_t": [-128, 127], "uint16_t": [0, 65535]}


def bit_patterns(bits: list[int], value: type, unsigned: type, seed: int) -> np.ndarray:
    """``bits`` plus 300 random finite values, as raw bit patterns."""
    rng = np.random.default_rng(seed)
    rand = rng.integers(0, np.iinfo(unsigned).max, 300, dtype=unsigned, endpoint=True)
    rand = rand[np.isfinite(rand.view(value))]
    return np.concatenate([np.array(bits, unsigned), rand])


def vector_init(ctype: str, var: str, values) -> str:
    return f"    std::vector<{ctype}> {var} = {{{', '.join(literal(v, ctype) for v in values)}}};"


@needs_gxx
def test_literals_read_back_bit_exact(tmp_path):
    f32 = bit_patterns(F32_BITS, np.float32, np.uint32, 1)
    f64 = bit_patterns(F64_BITS, np.float64, np.uint64, 2)
    body = [vector_init("float", "f", f32.view(np.float32)), vector_init("double", "d", f64.view(np.float64))]
    body += [vector_init(t, f"v_{t}", vs) for t, vs in INTS.items()]
    body += ['    for (float x : f) { uint32_t b; std::memcpy(&b, &x, 4); printf("%08x\\n", b); }',
             '    for (double x : d) { uint64_t b; std::memcpy(&b, &x, 8); '
             'printf("%016llx\\n", (unsigned long long)b); }']
    body += [f'    for (auto x : v_{t}) printf("%lld\\n", (long long)x);' for t in INTS]
    src = tmp_path / "literals.cpp"
    src.write_text(PRELUDE.replace("{includes}", "") + "int main()\n{\n" + "\n".join(body)
                   + "\n    return 0;\n}\n")
    error = compile_cpp(src, "-o", str(tmp_path / "literals"))
    assert error == "", error
    out = subprocess.run([str(tmp_path / "literals")], capture_output=True, text=True,
                         check=True).stdout.split()
    n32, n64 = len(f32), len(f64)
    assert np.array_equal(np.array([int(x, 16) for x in out[:n32]], np.uint32), f32)
    assert np.array_equal(np.array([int(x, 16) for x in out[n32:n32 + n64]], np.uint64), f64)
    assert [int(x) for x in out[n32 + n64:]] == [v for vs in INTS.values() for v in vs]


# --- results print exactly (run on the CPU stub library) ----------------------------------------
@pytest.fixture(scope="module")
def stub_lib(tmp_path_factory) -> str:
    cc = shutil.which("cc")
    if cc is None or GXX is None:
        pytest.skip("no C/C++ compiler: cannot build the stub library")
    out = tmp_path_factory.mktemp("stub") / "libaclnn_stub.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(FIXTURES / "aclnn_stub.c")],
                   check=True)
    return str(out)


def copy_through_plan(data: dict[str, np.ndarray]) -> CallPlan:
    """A plan with no calls: each array goes to the device and is printed back as a result."""
    users, tensors = [], []
    for name, a in data.items():
        acl = dtype_of(a.dtype).acl_name
        users.append(UserBuffer(name=name, dtype=acl, elems=a.size, written=True))
        tensors.append(TensorDesc(id=name, dtype=acl, dims=[a.size], strides=[1],
                                  storage_dims=[a.size], buffer="user", user=name))
    return CallPlan(op="copy", users=users, workspace_size=0, tensors=tensors, calls=[])


def printed(stdout: str) -> dict[str, np.ndarray]:
    """``name:`` headers followed by ``result[i] is: v`` lines → name → float32 values."""
    out: dict[str, list[float]] = {}
    for line in stdout.splitlines():
        if line.endswith(":"):
            out[line[:-1]] = current = []
        elif line.startswith("result["):
            current.append(float(line.split(" is: ")[1]))
    return {k: np.array(v, np.float32) for k, v in out.items()}


def same_floats(got: np.ndarray, want: np.ndarray) -> bool:
    """Bit-equal where not NaN; NaN (with its sign) where NaN."""
    nan = np.isnan(want)
    return (np.array_equal(np.isnan(got), nan)
            and np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
            and np.array_equal(np.signbit(got[nan]), np.signbit(want[nan])))


def run_on_stub(src: str, files: dict[str, bytes], stub_lib: str, tmp_path) -> dict[str, np.ndarray]:
    """Build the program (its .bin files beside it) against the stub library, run it there and
    read back what it printed."""
    (tmp_path / "prog.cpp").write_text(src)
    for name, blob in files.items():
        (tmp_path / name).write_bytes(blob)
    error = compile_cpp(tmp_path / "prog.cpp", stub_lib, "-o", str(tmp_path / "prog"))
    assert error == "", error
    run = subprocess.run([str(tmp_path / "prog")], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:]
    return printed(run.stdout)


@needs_gxx
def test_f32_f16_bf16_results_print_exactly(stub_lib, tmp_path):
    every = np.arange(65536, dtype=np.uint16)  # every f16 / bf16 bit pattern
    data = {"f32": np.array(F32_BITS, np.uint32).view(np.float32),
            "f16": every.view(np.float16), "bf16": every.view(DataType.BF16.np)}
    src, files = emit_cpp(copy_through_plan(data), data, embed_limit=100)
    assert sorted(files) == ["bf16.bin", "f16.bin"]
    got = run_on_stub(src, files, stub_lib, tmp_path)
    assert sorted(got) == ["bf16", "f16", "f32"]
    for name, a in data.items():  # numpy / ml_dtypes widen f16 and bf16 to float32 exactly
        assert same_floats(got[name], a.astype(np.float32)), name


@needs_gxx
def test_buffer_names_are_spelled_safely_and_uniquely(stub_lib, tmp_path):
    """A loaded graph's names may hold quotes, ``%`` and ``/``: the program spells each buffer
    with word characters only, in its variables, ``.bin`` files and messages, and two names that
    spell alike stay apart (they broke the C string literals and wrote files elsewhere)."""
    rng = np.random.default_rng(0)
    data = {name: rng.standard_normal(n).astype(np.float32)
            for name, n in (('q"%s\\', 300), ("up/../x", 300), ("a-b", 3), ("a_b", 3))}
    src, files = emit_cpp(copy_through_plan(data), data, embed_limit=100)
    assert sorted(files) == ["q__s_.bin", "up____x.bin"]
    assert '"%s' not in src and "up/" not in src
    got = run_on_stub(src, files, stub_lib, tmp_path)
    labels = {'q"%s\\': "q__s_", "up/../x": "up____x", "a-b": "a_b", "a_b": "a_b_1"}
    assert sorted(got) == sorted(labels.values())
    for name, a in data.items():
        assert same_floats(got[labels[name]], a), name


# --- fixture headers vs the documented public prototypes -----------------------------------------
# The prototypes as the reference sheet documents them. Phase 1 of the §4 ops ends with the
# common tail of §1.1; their phase 2 is the §4 form (aclnnInplaceCopy's takes const aclrtStream).
# Return type None: the sheet does not give it (§4 lists parameter lists only), so it is not
# checked. aclGetRecentErrMsg is named in §1.3 without a prototype: only its presence is allowed.
TAIL = "uint64_t *workspaceSize, aclOpExecutor **executor"
PHASE2 = "void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream"
PHASE2_CONST = "void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, const aclrtStream stream"
DOCUMENTED: dict[str, tuple[str | None, str]] = {
    # §3.1 runtime
    "aclInit": ("aclError", "const char *configPath"),
    "aclFinalize": ("aclError", ""),
    "aclrtSetDevice": ("aclError", "int32_t deviceId"),
    "aclrtResetDevice": ("aclError", "int32_t deviceId"),
    "aclrtCreateStream": ("aclError", "aclrtStream *stream"),
    "aclrtDestroyStream": ("aclError", "aclrtStream stream"),
    "aclrtSynchronizeStream": ("aclError", "aclrtStream stream"),
    "aclrtMalloc": ("aclError", "void **devPtr, size_t size, aclrtMemMallocPolicy policy"),
    "aclrtFree": ("aclError", "void *devPtr"),
    "aclrtMemcpy": ("aclError", "void *dst, size_t destMax, const void *src, size_t count, "
                                "aclrtMemcpyKind kind"),
    # §3.1 aclnn meta API
    "aclCreateTensor": ("aclTensor *", "const int64_t *viewDims, uint64_t viewDimsNum, "
                        "aclDataType dataType, const int64_t *stride, int64_t offset, aclFormat format, "
                        "const int64_t *storageDims, uint64_t storageDimsNum, void *tensorData"),
    "aclCreateIntArray": ("aclIntArray *", "const int64_t *value, uint64_t size"),
    "aclCreateScalar": ("aclScalar *", "void *value, aclDataType dataType"),
    "aclDestroyTensor": ("aclnnStatus", "const aclTensor *"),
    "aclDestroyIntArray": ("aclnnStatus", "const aclIntArray *"),
    "aclDestroyScalar": ("aclnnStatus", "const aclScalar *"),
    # §4 generic ops (phase 1)
    "aclnnCastGetWorkspaceSize": (None, f"const aclTensor *self, const aclDataType dtype, "
                                        f"aclTensor *out, {TAIL}"),
    "aclnnReduceSumGetWorkspaceSize": (None, f"const aclTensor *self, const aclIntArray *dims, "
                                             f"bool keepDims, aclDataType dtype, aclTensor *out, {TAIL}"),
    "aclnnDivGetWorkspaceSize": (None, f"const aclTensor *self, const aclTensor *other, "
                                       f"aclTensor *out, {TAIL}"),
    "aclnnExpandGetWorkspaceSize": (None, f"const aclTensor *self, const aclIntArray *size, "
                                          f"aclTensor *out, {TAIL}"),
    "aclnnInplaceCopyGetWorkspaceSize": (None, f"aclTensor *selfRef, const aclTensor *src, {TAIL}"),
    "aclnnInplaceFillScalarGetWorkspaceSize": (None, f"aclTensor *selfRef, const aclScalar *value, "
                                                     f"{TAIL}"),
    "aclnnInplaceOneGetWorkspaceSize": (None, f"const aclTensor *selfRef, {TAIL}"),
    # §4 generic ops (phase 2)
    **{api: (None, PHASE2) for api in ("aclnnCast", "aclnnReduceSum", "aclnnDiv", "aclnnExpand",
                                       "aclnnInplaceFillScalar", "aclnnInplaceOne")},
    "aclnnInplaceCopy": (None, PHASE2_CONST),
    # §5.1 the target op
    "aclnnBatchNormElemtBackwardGetWorkspaceSize": (
        "aclnnStatus", "const aclTensor *gradOut, const aclTensor *input, const aclTensor *mean, "
        "const aclTensor *invstd, const aclTensor *weight, const aclTensor *sumDy, "
        f"const aclTensor *sumDyXmu, aclTensor *counter, aclTensor *gradInput, {TAIL}"),
    "aclnnBatchNormElemtBackward": ("aclnnStatus", PHASE2_CONST),
    # the family (syncbn-family.md §2.1, §3.1, §5.1, §6.1; aclnn-api.md §6.4; BatchNormReduceBackward
    # from its op_api header as the family notes give it)
    "aclnnBatchNormStatsGetWorkspaceSize": ("aclnnStatus", "const aclTensor *input, double eps, aclTensor *mean, aclTensor *invstd, "
        f"{TAIL}"),
    "aclnnBatchNormStats": ("aclnnStatus", PHASE2_CONST),
    "aclnnBatchNormElemtGetWorkspaceSize": ("aclnnStatus", "const aclTensor *input, const aclTensor *weight, const aclTensor *bias, aclTensor *mean, aclTensor *invstd, double eps, aclTensor *output, "
        f"{TAIL}"),
    "aclnnBatchNormElemt": ("aclnnStatus", PHASE2_CONST),
    "aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize": ("aclnnStatus", "const aclTensor *input, const aclTensor *mean, const aclTensor *invstd, aclTensor *runningMean, aclTensor *runningVar, double momentum, double eps, const aclTensor *counts, aclTensor *meanAll, aclTensor *invstdAll, "
        f"{TAIL}"),
    "aclnnBatchNormGatherStatsWithCounts": ("aclnnStatus", PHASE2_CONST),
    "aclnnBatchNormReduceBackwardGetWorkspaceSize": ("aclnnStatus", "const aclTensor *gradOut, const aclTensor *input, const aclTensor *mean, const aclTensor *invstd, const aclTensor *weight, const bool inputG, const bool weightG, const bool biasG, aclTensor *sumDy, aclTensor *sumDyXmu, aclTensor *gradWeight, aclTensor *gradBias, "
        f"{TAIL}"),
    "aclnnBatchNormReduceBackward": ("aclnnStatus", PHASE2_CONST),
    "aclnnBatchNormReduceGetWorkspaceSize": ("aclnnStatus", "const aclTensor *x, aclTensor *sum, aclTensor *squareSum, "
        f"{TAIL}"),
    "aclnnBatchNormReduce": ("aclnnStatus", PHASE2),
    "aclnnSyncBatchNormGatherStatsGetWorkspaceSize": ("aclnnStatus", "const aclTensor *totalSum, const aclTensor *totalSquareSum, const aclTensor *sampleCount, aclTensor *mean, aclTensor *variance, float momentum, float eps, aclTensor *batchMean, aclTensor *batchInvstd, "
        f"{TAIL}"),
    "aclnnSyncBatchNormGatherStats": ("aclnnStatus", PHASE2),
}
NAMED_ONLY = {"aclGetRecentErrMsg"}
# aclnnop header → the APIs it must declare (reference §3.1: op headers are aclnnop/aclnn_<op>.h)
OP_HEADERS = {f"aclnnop/{h}": {api, api + "GetWorkspaceSize"} for api, h in HEADERS.items()}
OP_HEADERS.update({f"aclnnop/{s.aclnn_header}": {s.aclnn_api, s.aclnn_api + "GetWorkspaceSize"}
                   for s in op_api_specs().values() if s.aclnn_api and s.name.startswith("aclnnBatch")
                   or s.name == "aclnnSyncBatchNormGatherStats"})


def c_type(text: str) -> str:
    """``'const aclTensor*'`` → ``'const aclTensor *'``, ``'aclOpExecutor * *'`` → ``'... **'``."""
    return " ".join(re.findall(r"\w+|\*", text)).replace("* *", "**")


def param_types(params: str) -> tuple[str, ...]:
    """The types of a parameter list, names dropped (``void`` or empty: no parameters)."""
    out = []
    for p in filter(None, (q.strip() for q in params.split(","))):
        tokens = re.findall(r"\w+|\*", p)
        if len([t for t in tokens if t not in ("const", "*")]) > 1 and tokens[-1] != "*":
            tokens = tokens[:-1]  # the parameter name
        out.append(c_type(" ".join(tokens)))
    return () if out == ["void"] else tuple(out)


def declarations(path: Path) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Function declarations of a header: name → (return type, parameter types)."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", path.read_text(), flags=re.S)
    text = re.sub(r"^\s*#.*$", " ", text, flags=re.M).replace('extern "C" {', " ")
    found = re.findall(r"([A-Za-z_][\w\s*]*?)\b(\w+)\s*\(([^()]*)\)\s*;", text)
    return {name: (c_type(ret), param_types(params)) for ret, name, params in found}


def test_prototype_parser_reads_names_and_types():
    assert param_types("const aclTensor*, uint64_t *workspaceSize, bool keepDims") == (
        "const aclTensor *", "uint64_t *", "bool")
    assert param_types("void") == () and c_type("aclOpExecutor * * ") == "aclOpExecutor **"


ALL_HEADERS = sorted(str(p.relative_to(INCLUDE)) for p in INCLUDE.rglob("*.h"))


@pytest.mark.parametrize("header", ALL_HEADERS)
def test_fixture_header_declares_documented_prototypes(header):
    decls = declarations(INCLUDE / header)
    assert decls, f"no declarations parsed from {header}"
    for name, (ret, params) in decls.items():
        assert name in DOCUMENTED or name in NAMED_ONLY, f"{header}: {name} is not documented"
        if name in NAMED_ONLY:
            continue
        want_ret, want_params = DOCUMENTED[name]
        assert params == param_types(want_params), f"{header}: {name}{params}"
        if want_ret is not None:
            assert ret == c_type(want_ret), f"{header}: {name} returns {ret}"
    if header in OP_HEADERS:
        assert set(decls) == OP_HEADERS[header]


def test_every_documented_prototype_and_emitted_api_has_a_fixture():
    declared = {n for h in ALL_HEADERS for n in declarations(INCLUDE / h)}
    assert set(DOCUMENTED) | NAMED_ONLY == declared
    assert set(OP_HEADERS) <= set(ALL_HEADERS)
