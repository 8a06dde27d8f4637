"""``NullConnector``: the connector contract (``connectors.base.KVConnectorBase``) with no
store behind it: no external tokens, nothing to load or save. Test connectors subclass it and
override the seams they record or break."""
from connectors.base import KVConnectorBase


class NullConnector(KVConnectorBase):
    """Every seam a no-op: 0 external tokens, no loads, saves always flushed, no counters."""

    def get_num_new_matched_tokens(self, seq, num_computed):
        return 0, False

    def update_state_after_alloc(self, seq, block_ids, num_external):
        pass

    def request_finished(self, seq, block_ids):
        pass

    def register_kv_caches(self, kv_cache, block_size):
        pass

    def start_load_kv(self, sched_out, kv_cache):
        pass

    def wait_for_load(self):
        return []

    def save(self, sched_out, kv_cache):
        pass

    def wait_for_save(self, timeout_s=None):
        return True

    def get_stats(self):
        return {}
