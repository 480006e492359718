"""Triton's interpreter (TRITON_INTERPRET=1) for the suite's kernel tests, without its repeated set-up.

A kernel launch (`GridExecutor`) patches the language modules its kernel sees for the interpreter and
restores them when it ends. Every nested `@triton.jit` call inside the kernel (the kernel's helpers, and
`tl.zeros` or `tl.max`, which see `triton.language.core`) patches the modules it sees again
(`InterpretedFunction.__call__` -> `_patch_lang`), walking every member, and never restores that. Once a
module is patched in a launch, patching it again changes nothing: a wrapped builtin is no builtin (skipped),
and the rest is set to the same definitions. That repeated walk was half of the interpreted kernel tests'
time (tests/test_grad_summary_triton.py's child: 45 of 83 s under cProfile).
`patch_language_once_per_launch()` skips a nested call's patching when the launch in progress (or a nested
call in it) already patched every language module the nested function sees; anything else is patched as
before, and a Triton without `_patch_lang` is left as it is. The kernels compute the same: the children's
reports were byte-identical with and without it.

    python tests/interpreter_support.py -m MODULE ARGS...   # MODULE as __main__, interpreted, patched once
"""
from __future__ import annotations

import inspect
import os
import runpy
import sys
from typing import Any


def patch_language_once_per_launch() -> None:
    """Under TRITON_INTERPRET=1, before a kernel runs: nested `@jit` calls reuse their launch's patching."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original = getattr(interp, "_patch_lang", None)
    if original is None:                      # another interpreter: left alone (only slower)
        return
    launch: dict[str, Any] = {"scope": None, "langs": frozenset()}

    def langs_of(fn: Any) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn: Any) -> Any:
        langs = langs_of(fn)
        if launch["scope"] is not None:       # a nested call (its return value is not used)
            if not langs <= launch["langs"]:  # a module this launch has not patched yet (the standard
                original(fn)                  # library's @jit functions see triton.language.core)
                launch["langs"] |= langs
            return launch["scope"]
        scope = original(fn)                  # a launch (GridExecutor): it restores the scope when it ends
        restore = scope.restore

        def restore_and_end() -> None:
            launch["scope"], launch["langs"] = None, frozenset()
            restore()

        scope.restore = restore_and_end
        launch["scope"], launch["langs"] = scope, langs
        return scope

    interp._patch_lang = patch_lang


if __name__ == "__main__":
    if sys.argv[1:2] != ["-m"] or len(sys.argv) < 3:
        sys.exit("usage: python tests/interpreter_support.py -m MODULE ARGS...")
    os.environ["TRITON_INTERPRET"] = "1"      # before triton is first imported
    patch_language_once_per_launch()
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
