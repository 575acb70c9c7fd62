"""tidal: an OpenAI-compatible LLM inference server on Trio's structured concurrency.

The package is split along the process boundary:

* ``tidal/``          the frontend (Trio, quart-trio, hypercorn): CLI, HTTP/WebSocket API,
                      request lifecycle, admission, the engine client.
* ``tidal/gpu/``      the engine child process (torch): scheduler, KV blocks, model, sampler.
* ``tidal/kernels/``  Triton kernels, each beside its plain-torch reference.
* ``tidal/wire.py``   the one module both sides import: the messages that cross the pipe.

This file stays import-free so the engine process can import ``tidal.wire`` without
pulling in the frontend's libraries.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
