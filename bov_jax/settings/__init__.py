"""The configuration: the schema with its defaults and the checks of each setting alone
(config.py, also the embedded default config file), the value modes and the paper's
presets of them (values.py), and the model spec resolved from the model section
(model_spec.py).

Imports: nothing of the package.
"""
