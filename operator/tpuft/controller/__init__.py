"""The operator: kopf's handlers, the reconciler and its pure phase logic.

Run in the operator's pod (`kopf run -m tpuft.controller.handlers`, the chart's Deployment).
It uses tpuft.api; neither the API nor the workload imports it."""
