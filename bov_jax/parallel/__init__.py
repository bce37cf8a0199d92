"""Distribution: the device mesh and the one table mapping logical axes to mesh axes
(sharding.py), and where the optimizer's state lives and its update runs
(state_layout.py).

Imports: settings.
"""
