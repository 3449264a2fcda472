"""Install recipes of the peer packages measured by ``kvz bench --lossy --peers``.

Each peer gets its own virtual environment under ``~/.cache/kvcodec/peers/<name>``
(they pin versions that conflict with each other and with kvcodec).  torch is
pinned to the local CPU build through a constraints file, so no peer can pull
a CUDA build.  Versions are the ones ``../shared/design/peers.md`` measured.
"""

TORCH = "torch==2.13.0"

RECIPES = {
    # transformers' QuantizedCache backends
    "quanto": ["transformers==5.24.0", "optimum-quanto==0.2.7"],
    "hqq": ["transformers==5.24.0", "hqq==0.2.8.post1"],
    # TurboQuant implementations
    "turboquant": ["turboquant==0.2.0", "numpy<2.4", "scipy"],
    "tiny-turboquant": ["tiny-turboquant==0.18.0", "scipy"],
    "fused-turboquant": ["fused-turboquant==0.1.0", "triton", "scipy"],
    # LMCache's CacheGen serde (long install: pulls cupy and cloud clients)
    "lmcache": ["lmcache==0.5.6"],
}
COMMON = ["numpy", "safetensors"]
