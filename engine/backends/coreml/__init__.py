"""The Core ML runtime backend: converted bundles run by Core ML (on the Neural Engine by default).

What the converter (`coreml/`, a tool above the engine) writes and this package reads is defined here: the bundle
layout (`bundle`, `package`, `milblob`), the programs' interface and the compression and compute-unit names
(`programs`), and where a conversion is cached (`cache`). The runtime is `runtime.CoreMLBackend` over
`host.PackageBackend`, with `watchdog` for calls that never return. Imported only by the backend registry, lazily
and on a Mac (and by tests): several modules import coremltools at module level.
"""
