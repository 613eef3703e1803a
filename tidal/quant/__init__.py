"""Weight formats (int8 / int4 weight-only, fp8 storage) swapped into a loaded model, and the accuracy gate."""
