"""edgetvm: an LLM compiler for edge NPUs (TCM + DMA + static command stream) on Apache TVM.

Entry points: ``python -m edgetvm.run`` (compile + run on the emulated NPU),
``python -m edgetvm.inspect`` (what the compiler recognised), ``python -m edgetvm.rpc_server``
(the emulator as an RPC server behind a TVM tracker). The packages: ``edgetvm.frontend`` (ONNX in),
``edgetvm.relax_passes`` (LLM semantics, quantization), ``edgetvm.tir_schedules`` (kernel
templates), ``edgetvm.target`` (the NPU: spec, ISA, lowering, emulator).
"""
__version__ = "0.2.0"
