"""exllamav3 1.6.5's `Generator` drafting through dspark-ray in place of its DSpark drafter (docs/exllamav3.md):

    config = Config.from_directory(model_dir)
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=32768, max_history=config.dspark_block_size + 1)
    model.load()
    drafter = RemoteDrafter("10.0.0.5:7001", config)                       # HELLO: refuses another drafter
    generator = Generator(model, cache, Tokenizer.from_config(config),
                          draft_model=drafter, draft_cache=drafter.cache_for(cache))
    drafter.bind(generator)                                                 # which sequence each row is
"""
from .remote_drafter import RemoteDrafter

__all__ = ["RemoteDrafter"]
