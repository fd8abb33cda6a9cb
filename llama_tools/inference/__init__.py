"""Running the model: the streamed float64/fp32 reference, generation and sampling."""
