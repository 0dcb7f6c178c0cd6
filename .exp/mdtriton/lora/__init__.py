"""LoRA adapters for served pipelines: kept beside the model in its repository (`MODEL/loras/NAME.safetensors`, put
there by `mdtriton lora add`: mdtriton.build_tools.adapters), named per request by the `loras` input, and added into
each rank's shard of the transformer's weights for the requests that name them (mdtriton.lora.weights).

An adapter is stored in one form whatever it came as (mdtriton.lora.adapter_file): for each linear module of the
transformer that it changes, under diffusers' module name, its factors A [rank, in] and B [out, rank] and the scaling
diffusers' peft layers would apply (alpha / rank), so that the module's weight becomes W + scale * scaling * B A.
"""
