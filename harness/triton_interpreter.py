"""Test scaffolding, never product code: two patches of Triton's runtime that let fla's and liger's
Triton kernels run on a CPU under Triton's interpreter (TRITON_INTERPRET=1), so the kernel tier
(tests/kernels/, benchmarks/kernels/) can compare them with transformers' torch functions on a
machine without a GPU. Written against triton 3.7.1 (torch 2.13's pin; the `kernels` extra pins
it): `install` refuses any other version, since both patches reach into the runtime's internals.
A third patch (c) lists the CPU among the devices transformers (5.25 on) lets fla run on.

What the interpreter is not: it runs each program of the grid in numpy, one after another, so it
says nothing about speed, and its bf16 arithmetic is wrong (it multiplies the raw bits), so the tier
compares fp32 only.

`install()` must run before fla is imported (transformers imports fla when its qwen3_5 modeling
module is first imported): `triton.jit` makes a kernel an interpreted function only if
TRITON_INTERPRET is set when the kernel is decorated, i.e. when fla's modules are imported, and
fla reads the Triton backend once at import too.
"""

from __future__ import annotations

import ast
import os
import sys

TRITON_VERSION = "3.7.1"
_LOOP_HELPER = "_dflash_interpreter_loop_tensors"   # the name the rewritten kernels call (patch b)
_installed = False


def install() -> None:
    """Apply the patches (once). Refuses without TRITON_INTERPRET=1, with another triton, or after
    fla was imported."""
    global _installed
    if _installed:
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("harness.triton_interpreter patches Triton's interpreter: run with TRITON_INTERPRET=1 "
                           "set before anything imports triton or fla (README: Run the tests)")
    if "fla" in sys.modules:
        raise RuntimeError("fla was imported before harness.triton_interpreter.install(): install the patches first")
    import triton

    if triton.__version__ != TRITON_VERSION:
        raise RuntimeError(f"the interpreter patches are written for triton {TRITON_VERSION}, found {triton.__version__}: "
                           "install the `kernels` extra (pyproject.toml), or port harness/triton_interpreter.py")
    _autotuner_measures_nothing()
    _loop_variables_are_tensors()
    _transformers_runs_fla_on_the_cpu()
    _installed = True


def _transformers_runs_fla_on_the_cpu() -> None:
    """Patch (c), transformers 5.25 on: the qwen3_5 ops' binding runs the torch function for inputs on
    a device the bound package is not listed for (fla: cuda, xpu, mlu, npu), so on this CPU fla would
    be bound and never called. Under the interpreter fla does run on the CPU: list it there. The
    binding reads the table when modeling_qwen3_5 is imported, so this goes first. Releases before
    5.25 have no table and call what they bound on any device."""
    if "transformers.models.qwen3_5.modeling_qwen3_5" in sys.modules:
        raise RuntimeError("transformers' qwen3_5 modeling was imported before harness.triton_interpreter.install()")
    from transformers.integrations import hub_kernels

    table = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if table is not None and "fla" in table and "cpu" not in table["fla"]:
        table["fla"] = (*table["fla"], "cpu")


def _autotuner_measures_nothing() -> None:
    """Patch (a), triton 3.7.1: `Autotuner.run` times every config that survives pruning by calling
    `_bench`, which asks the active driver for a benchmarker; under the interpreter there is no
    driver ("0 active drivers"), and timing interpreted kernels would cost minutes anyway. Every
    config now times 0, so the autotuner keeps the first config that survives pruning (`min` keeps
    the first of equals) and runs the kernel once, with it. Configs differ in block sizes and warps,
    which change the order of fp32 sums, not what a kernel computes."""
    from triton.runtime.autotuner import Autotuner

    def _bench(self, *args, config, **meta):
        return [0.0, 0.0, 0.0]   # the (median, 20%, 80%) quantiles `_bench` returns

    Autotuner._bench = _bench


class _LoopVariablesAreTensors(ast.NodeTransformer):
    """Patch (b)'s rewrite: `for i in range(...)` and `for i in tl.range(...)` become
    `for i in <helper>(range(...))`. `tl.static_range` is left alone: its variable is a constexpr
    (a Python int) in compiled Triton as well."""

    def __init__(self, base: ast.NodeTransformer):
        self.base = base

    def visit_Assign(self, node):
        return self.base.visit_Assign(node)   # the interpreter's own rewrite of assignments

    def visit_For(self, node):
        self.generic_visit(node)
        call = node.iter
        if isinstance(call, ast.Call) and (
                isinstance(call.func, ast.Name) and call.func.id == "range"
                or isinstance(call.func, ast.Attribute) and call.func.attr == "range"):
            node.iter = ast.Call(func=ast.Name(id=_LOOP_HELPER, ctx=ast.Load()), args=[call], keywords=[])
        return node


def _loop_variables_are_tensors() -> None:
    """Patch (b), triton 3.7.1: in compiled Triton a `range` / `tl.range` loop variable is a scalar
    tensor, and kernels call tensor methods on it (fla 0.6.0, fla/ops/common/chunk_delta_h.py:
    `i_t.to(tl.int64)`); the interpreter runs the loop as Python's `range`, whose ints have no
    `.to`. Its function rewriter (which already wraps every assignment in `to_tensor`) now also
    wraps those loops' iterables so each value is an int32 scalar tensor (int64 where the range
    does not fit in int32), as the compiler types a loop over int32 bounds. The helper reaches
    the kernels' globals the way the interpreter's own `interpreter_semantic` does: the rewriter
    copies the interpreter module's globals into them."""
    from triton.runtime import interpreter
    import triton.language as tl

    semantic = interpreter.interpreter_semantic

    def loop_tensors(values):
        ints = range(values.start, values.stop, values.step) if isinstance(values, range) else list(values)
        fits = all(-2**31 <= v < 2**31 for v in (ints[0], ints[-1])) if len(ints) else True
        dtype = tl.int32 if fits else tl.int64
        for value in ints:
            yield semantic.scalar_constant(int(value), dtype=dtype)

    setattr(interpreter, _LOOP_HELPER, loop_tensors)
    interpreter.FunctionRewriter.ast_transformer = _LoopVariablesAreTensors(interpreter.ASTTransformer())
