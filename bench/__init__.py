"""The measuring tools, above the product: `dspark bench` (served AR vs speculation, bench/served.py and its CLI),
the engine bench (ms per target forward), other engines' AR as baselines (llama.cpp, HF transformers) and a
delaying link proxy. The services and the SDK never import this package."""
