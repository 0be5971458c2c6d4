"""The formats every stage reads: model sources (built-in names, HF checkpoints, GGUF files)
and their conversion, the checkpoint reader, the artifact manifest, and the project-wide
error type. Serving needs them without quantizing anything, so they live below quantize/.
"""
