"""The passes of the build, one module per stage; `onnxgrad.pipeline` lists them in order."""
