"""aclnnBatchNormElemtBackward in BFLOAT16 — the Python twin of ops-nn's
examples/test_aclnn_batch_norm_elemt_backward_bfloat16.cpp.

BF16 tensors are numpy arrays of ``ml_dtypes.bfloat16``. BF16 always computes in FLOAT and is
rounded back to BF16 at the end, so result[1] = bf16(0.9) = 0.898438. BF16 is accepted on
Ascend910B / Ascend910_93 / Ascend950 (the default platform is Ascend910B).

Run: python examples/batch_norm_elemt_backward_bfloat16.py
"""
import sys

import ml_dtypes
import numpy as np

import opgraph
from opgraph.aclnn import (aclGetRecentErrMsg, aclnnBatchNormElemtBackward,
                           aclnnBatchNormElemtBackwardGetWorkspaceSize)


def CHECK_RET(ret, what):
    if ret != opgraph.Status.ACLNN_SUCCESS:
        print(f"{what} failed. ERROR: {int(ret)} {aclGetRecentErrMsg()}")
        sys.exit(1)


def main() -> int:
    bf16 = ml_dtypes.bfloat16
    grad_input_host = np.zeros((1, 2, 4), dtype=bf16)
    gradOut = opgraph.tensor(np.arange(8).reshape(1, 2, 4).astype(bf16))
    input = opgraph.tensor(np.arange(8).reshape(1, 2, 4).astype(bf16))
    mean = opgraph.tensor(np.array([0, 0], dtype=bf16))
    invstd = opgraph.tensor(np.array([1, 1], dtype=bf16))
    weight = opgraph.tensor(np.array([1, 1], dtype=bf16))
    sumDy = opgraph.tensor(np.array([0, 0], dtype=bf16))
    sumDyXmu = opgraph.tensor(np.array([1, 1], dtype=bf16))
    counter = opgraph.tensor(np.float32([5, 5]))          # counter has no BF16
    gradInput = opgraph.tensor(grad_input_host)

    ret, workspaceSize, executor = aclnnBatchNormElemtBackwardGetWorkspaceSize(
        gradOut, input, mean, invstd, weight, sumDy, sumDyXmu, counter, gradInput)
    CHECK_RET(ret, "aclnnBatchNormElemtBackwardGetWorkspaceSize")
    print(f"workspaceSize = {workspaceSize}, {len(executor.graph.nodes)} l0 ops recorded")

    workspaceAddr = bytearray(workspaceSize) if workspaceSize > 0 else None
    ret = aclnnBatchNormElemtBackward(workspaceAddr, workspaceSize, executor, None)
    CHECK_RET(ret, "aclnnBatchNormElemtBackward")

    for i, v in enumerate(grad_input_host.ravel()):
        print(f"result[{i}] is: {float(v):f}")   # BF16 printed as float
    return 0


if __name__ == "__main__":
    sys.exit(main())
