"""A test helper: the op_apis opgraph ships (not those tests or ``--load`` plugins register)
and the default call of one, with the arrays its generator makes.

    >>> "aclnnBatchNormStats" in [s.name for s in shipped_op_apis()]
    True
    >>> cfg, arrays = default_call(get_op_api("aclnnBatchNormStats"))
    >>> arrays["input"].shape == cfg.shape
    True
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from opgraph.core.dtypes import DataType
from opgraph.core.opapi import InputConfig, OpApiSpec, get_op_api, op_api_specs
from opgraph.core.platform import get_platform


def shipped_op_apis() -> list[OpApiSpec]:
    """The op_apis of ``opgraph.aclnn`` that can make their inputs, by name."""
    return [s for _, s in sorted(op_api_specs().items())
            if s.make_inputs is not None and s.get_workspace_size.__module__.startswith("opgraph.aclnn.")]


def default_call(spec: OpApiSpec, dtype: Optional[DataType] = None, seed: int = 0
                 ) -> tuple[InputConfig, dict[str, Any]]:
    """``(config, arrays by parameter name)`` of ``spec`` at its default shape and options, in
    ``dtype`` (default: the first it takes on the current platform)."""
    cfg = InputConfig(spec.default_shape, dtype or spec.dtypes(get_platform())[0],
                      {o.name: o.default for o in spec.options})
    return cfg, spec.make_inputs(cfg, np.random.default_rng(seed))


__all__ = ["default_call", "get_op_api", "shipped_op_apis"]
