"""What the Triton model needs beyond the engine, kept free of Triton imports so that it can be tested
alone: request parsing (`request`) and the threads that step the engine and send responses (`engine_thread`)."""
