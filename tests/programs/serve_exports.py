"""Run by tests/integration/test_estimator_lifecycle.py in one plain process:
``python serve_exports.py HELD_OUT.npz EXPORT...``.

Loads each SavedModel export and serves the held-out examples; prints the
accuracy of each as one JSON line. Shows that the exports serve without MPI
or mpi_strategy (it asserts that neither was imported).
"""

import json
import sys

import numpy as np
import tensorflow as tf

held_out = np.load(sys.argv[1])
features, labels = held_out["features"], held_out["labels"]
out = {}
for path in sys.argv[2:]:
    served = tf.saved_model.load(path)  # keep a reference: it owns the variables
    logits = served.serve(tf.constant(features)).numpy()
    out[path] = float(np.mean(np.argmax(logits, axis=1) == labels))
assert "mpi4py" not in sys.modules and "mpi_strategy" not in sys.modules, sorted(sys.modules)
print(json.dumps(out))
