"""A copy of a GGUF file with some keys or tensors changed: the tests' way to make the files a
model loader must refuse (or accept) without writing each one by hand."""
import numpy as np


def rewrite_gguf(src, dst, arch: str, kv_edit=None, tensor_edit=None, extra=()):
    """Copy src to dst as an ``arch`` file. kv_edit(key, value) -> the new value, or None to drop
    the key; tensor_edit(name, array) -> the new array; extra: (key, value, type, sub_type) added."""
    import gguf
    from minigraph.models.gguf_io import _field_value
    T = gguf.GGUFValueType
    rd = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch)
    for name, f in rd.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        v = _field_value(f)
        if kv_edit:
            v = kv_edit(name, v)
            if v is None:
                continue
        sub = f.types[-1] if f.types[0] == T.ARRAY else None
        w.add_key_value(name, v, f.types[0], sub_type=sub)
    for name, v, t, sub in extra:
        w.add_key_value(name, v, t, sub_type=sub)
    for t in rd.tensors:
        arr = np.array(t.data)
        if tensor_edit:
            arr = tensor_edit(t.name, arr)
        w.add_tensor(t.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
