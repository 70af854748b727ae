"""The operator: kopf handlers, the reconciler and its pure phase logic.

Run in the operator's pod (`kopf run -m tpuft.controller.handlers`); uses tpuft.api only.
Never imported by the workload or the CLI's laptop-only modules' callers at import time."""
