// Functions of the patched llama.cpp (llama_kvp_*), looked up at run time: the extension also runs on the stock
// library, which lacks them.
#pragma once

namespace kvp {

// `name` in the libllama this process loaded, null if that library has no such function. The extension links
// libllama by SONAME, so that is the copy llama_cpp loaded.
void* kvp_symbol(const char* name);

}  // namespace kvp
