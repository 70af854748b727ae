"""The local cluster and demo: what runs on a laptop, never in the operator image.

`tpuft cluster ...`, `tpuft images ...`, `tpuft demo` and `tpuft chat` live here; the
operator image installs only `tpuft` (the operator) and offers run/topology/validate/render.
"""
