"""A stand-in for NVIDIA Transformer Engine, for the Megatron-Bridge tests on CPU only.

Why: Megatron-Bridge 0.6.2 imports ``transformer_engine`` (and names ``transformer_engine.pytorch``
classes in annotations and ``isinstance`` checks) at import time, e.g. in ``peft/lora_layers.py``,
but Transformer Engine needs CUDA and cannot be installed on the CPU CI machine. The data path the
tests exercise (dataset provider, Energon data module, dataloader-state save and load) never calls
into it. tests/test_bridge.py puts this folder on ``sys.path`` only after ``megatron.core`` has
been imported and has decided that Transformer Engine is absent, so megatron-core keeps its
non-TE code paths, and takes it off again once Bridge is imported; nothing here is installed
into site-packages.

Every attribute of ``transformer_engine.pytorch`` (and of its attributes) is a placeholder class,
so annotations and ``isinstance`` checks work and any real use fails loudly.
"""

__version__ = "0.0.0+cpu.stand.in"
