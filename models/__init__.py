"""The llama.cpp layer: recurrent memory, graph inputs, the conv-state store, model graphs."""
