"""What a run is, before anything starts: topology strings (topology), the model registry
(model_specs, model_specs.yaml, schema), the placement of roles on devices (plan), the weights
(models), this machine's devices (devices) and the table of variables (settings)."""
