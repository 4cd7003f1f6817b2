"""ctxpatch core: exact context-to-weight patches (Goldwaser et al., arXiv 2511.17864).

Everything that computes lives here; nothing here imports Qt.
"""

__version__ = "0.1.0"
