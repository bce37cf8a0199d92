"""Distribution: the device mesh and the one table mapping logical axes to mesh axes
(sharding.py); value-table lookups that never gather a split table, and tables in host
memory (lookup.py); a batch's per-row sum reduced once (rowsum.py); and where the
optimizer's state lives and its update runs (state_layout.py).

Imports: settings.
"""
