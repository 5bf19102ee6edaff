"""Two gaps of triton 3.6's interpreter, patched for the CPU runs of the kernels."""

from __future__ import annotations

import numpy as np


def patch_interpreter() -> None:
    """Work around two gaps of triton 3.6's interpreter; both patches are idempotent.

    - Its scalars are 1-element arrays and ``__index__`` calls ``int()`` on them, which
      numpy>=2.4 refuses, so loops with runtime bounds fail (triton#9171, fixed upstream
      by triton#9172 the same way).
    - It stores bfloat16 as uint16 and ``tl.dot`` multiplies the bit patterns
      (triton#11584). Converting the operands to fp32 first is exact and matches the GPU
      (bf16 products accumulated in fp32).
    """
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_mtpdraft_patched", False):
        return
    original_patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor: type, scope: interpreter._LangPatchScope) -> None:
        original_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).item()))

    def to_fp32(x: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    original_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(
        self: interpreter.InterpreterBuilder,
        a: interpreter.TensorHandle,
        b: interpreter.TensorHandle,
        *args: object,
    ) -> interpreter.TensorHandle:
        return original_dot(self, to_fp32(a), to_fp32(b), *args)

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter.InterpreterBuilder.create_dot = create_dot
    interpreter._mtpdraft_patched = True
