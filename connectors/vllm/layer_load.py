"""Layer-wise loads of the vLLM connector: one step's store reads and scatters run on a
background thread, layer after layer, so the forward pass starts at once and layer ``i``'s
attention waits only until layer ``i``'s KV is in the paged cache. No vLLM import here.

One step, ``L`` layers (``start`` from ``start_load_kv``, ``wait_layer(i)`` from vLLM's
``wait_for_layer_load`` inside layer ``i``'s attention)::

    loader thread   | fetch (store get, check) | scatter 0 | scatter 1 | ... | scatter L-1 |
    forward pass    | embed | wait 0 | attn 0 | mlp 0 | wait 1 | attn 1 | ...
                               ^ returns once "scatter 0" is done, whatever layers 1.. do
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger("kvstore.connectors.vllm")


class LayerLoad:
    """One step's load, run by ``Loader``; ``wait_layer(i)`` blocks until layer ``i`` is
    written (or the load stopped), ``wait()`` until every layer is.

    Args:
        num_layers: layers of the paged cache.

    Attributes:
        error: the exception that stopped the load early (the ``on_error`` callback has
            run), else None.
    """

    def __init__(self, num_layers: int) -> None:
        self._layers = [threading.Event() for _ in range(num_layers)]
        self._all = threading.Event()
        self.error: BaseException | None = None

    def run(self, fetch: Callable[[], Any], scatter_layer: Callable[[Any, int], None],
            on_error: Callable[[BaseException], None]) -> None:
        """``moves = fetch()``, then ``scatter_layer(moves, i)`` for each layer in order, each
        layer released as soon as it is written. An exception stops the load: ``on_error``
        runs (it marks the blocks failed) before any waiter is released."""
        try:
            moves = fetch()
            for i, ev in enumerate(self._layers):
                scatter_layer(moves, i)
                ev.set()
        except BaseException as e:   # a load never kills the loader thread
            self.error = e
            try:
                on_error(e)
            except Exception:
                log.exception("kvstore layer-wise load: error handler failed")
        finally:
            for ev in self._layers:
                ev.set()
            self._all.set()

    def wait_layer(self, layer: int) -> None:
        """Block until layer ``layer`` is written (or the load stopped)."""
        self._layers[layer].wait()

    def wait(self) -> None:
        """Block until the whole load is done (or stopped)."""
        self._all.wait()

    @property
    def done(self) -> bool:
        return self._all.is_set()


class Loader:
    """A background thread running ``LayerLoad``s one at a time (one per step).

    Args:
        num_layers: layers of the paged cache.
        name: the thread's name.
    """

    def __init__(self, num_layers: int, name: str = "kvstore-vllm-loader") -> None:
        self.num_layers = num_layers
        self._cv = threading.Condition()
        self._queue: list[tuple[LayerLoad, tuple]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def start(self, fetch: Callable[[], Any], scatter_layer: Callable[[Any, int], None],
              on_error: Callable[[BaseException], None]) -> LayerLoad:
        """Queue one load (``LayerLoad.run``'s arguments); returns it for waiting.

        Raises:
            RuntimeError: the loader is closed.
        """
        load = LayerLoad(self.num_layers)
        with self._cv:
            if self._closed:
                raise RuntimeError("layer loader is closed")
            self._queue.append((load, (fetch, scatter_layer, on_error)))
            self._cv.notify()
        return load

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                load, args = self._queue.pop(0)
            load.run(*args)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued loads (bounded wait) and stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout_s)
