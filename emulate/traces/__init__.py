"""Device traces in FedScale's format (fedper.emulate.clock): the shipped synthetic one and its generator."""
