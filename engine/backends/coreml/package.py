"""An .mlpackage on disk: its spec (protobuf), weight file, functions and MLoT Spark provenance metadata.

Layout (what coremltools writes and Core ML reads):
    PKG/Manifest.json                              item list; rootModelIdentifier names the model spec
    PKG/Data/com.apple.CoreML/model.mlmodel        Model protobuf (coremltools.proto.Model_pb2)
    PKG/Data/com.apple.CoreML/weights/weight.bin   blob storage (see milblob)
Reading uses only the protobuf classes, so it works on any OS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from coremltools.proto import Model_pb2

from engine.backends.coreml.errors import PackageError

PROVENANCE_PREFIX = "spark."


@dataclass
class Package:
    path: Path
    spec: Model_pb2.Model
    spec_path: Path

    @classmethod
    def open(cls, path: str | Path) -> Package:
        path = Path(path).expanduser()
        if not path.is_dir():
            raise PackageError(f"{path} is not a Core ML package folder (.mlpackage).")
        spec_path = _root_spec_path(path)
        spec = Model_pb2.Model()
        try:
            spec.ParseFromString(spec_path.read_bytes())
        except Exception:
            raise PackageError(f"{spec_path.name} in {path.name} is not a valid Core ML model spec.") from None
        if spec.WhichOneof("Type") != "mlProgram":
            raise PackageError(f"{path.name} is not an ML Program; MLoT Spark packages are ML Programs.")
        return cls(path, spec, spec_path)

    @property
    def weights_path(self) -> Path:
        return self.spec_path.parent / "weights" / "weight.bin"

    def resolve_blob(self, file_name: str) -> Path:
        prefix = "@model_path/"
        if not file_name.startswith(prefix):
            raise PackageError(f"A weight names the file {file_name!r}, outside the package.")
        return self.spec_path.parent / file_name[len(prefix) :]

    @property
    def function_names(self) -> list[str]:
        return list(self.spec.mlProgram.functions)

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self.spec.description.metadata.userDefined)

    @property
    def provenance(self) -> dict[str, str]:
        return {k[len(PROVENANCE_PREFIX) :]: v for k, v in self.metadata.items() if k.startswith(PROVENANCE_PREFIX)}

    def set_provenance(self, values: dict[str, str]) -> None:
        """Write `values` (prefixed) into the spec's user-defined metadata and save the spec file in place."""
        meta = self.spec.description.metadata.userDefined
        for k, v in values.items():
            meta[PROVENANCE_PREFIX + k] = v
        self.spec_path.write_bytes(self.spec.SerializeToString())


def _root_spec_path(pkg: Path) -> Path:
    manifest = pkg / "Manifest.json"
    try:
        m = json.loads(manifest.read_text(encoding="utf-8"))
        root = m["itemInfoEntries"][m["rootModelIdentifier"]]["path"]
        if not isinstance(root, str):
            raise TypeError(root)
    except FileNotFoundError:
        raise PackageError(f"{pkg.name} has no Manifest.json; it is not a complete .mlpackage.") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise PackageError(f"The Manifest.json of {pkg.name} is unreadable; the package is corrupt.") from None
    spec_path = pkg / "Data" / root
    if not spec_path.is_file():
        raise PackageError(f"{pkg.name} lacks its model spec {root}; the package is incomplete.")
    return spec_path
