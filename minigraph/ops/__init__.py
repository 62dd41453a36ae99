"""Op definitions, grouped by family. Importing this package fills the registry."""
from . import views, copy, index, elementwise, reduce, matmul, ssm, rope, attention  # noqa: F401
