"""Storage tiers, fastest first: ``gpu`` (device pool), ``cpu`` (host arena), ``disk`` (lmdb).

Each tier owns its data, index and eviction policy; only ``kvstore.store`` moves chunks
between tiers (see ``base.Tier`` for the contract).
"""
