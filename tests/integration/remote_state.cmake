# remote_state: kvshare-serve --prefill-remote with a STOCK llama-server (LLAMA_SERVER) as the
# decoder: kvshare-provider-server answers POST /prefill-state with a state file bound to the
# model, the tokenizer and the state version, serve checks the binding and the decoder
# restores it (docs/remote.md, "A stock llama-server across hosts"). On loopback; exit 77
# (skipped) without LLAMA_SERVER.
add_test(NAME remote_state_stock_llama_server
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/remote_state.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(remote_state_stock_llama_server PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77 LABELS remote)
