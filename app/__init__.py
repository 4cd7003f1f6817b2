"""ctxpatch application: the command line and the Qt desktop window."""
