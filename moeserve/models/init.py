def init_model(*a, **k):
    raise NotImplementedError
