"""The TPUFinetune API: its fields, schema, status and shared names.

Imported by the controller, the CLI and the workload (in the Ray pods); it imports none of them.
Pure: no Kubernetes client, no kopf, no I/O."""
