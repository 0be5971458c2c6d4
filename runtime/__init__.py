"""Online half of qserve: models, engine, server and command line."""

from ..kernels import cpu_class as _cpu_class

# QSERVE_CPU_CLASS caps torch's kernels as well as qserve's, and torch reads its cap once,
# when it is imported: so before any module of the runtime imports it.
try:
    _cpu_class.apply_to_torch()
except _cpu_class.CpuClassError as _exc:  # a bad QSERVE_CPU_CLASS: the reason, no traceback
    raise SystemExit(f"qserve: {_exc}") from None
