# resident_provider: kvshare-serve with a resident provider (kvshare-prefill and
# llama-kvshare-prefill, started once; and one reached at a socket) on both routes, the
# patched llama-server as the decoder (LLAMA_SERVER_KVSHARE=path). Exit 77 = skipped.
add_test(NAME llama_server_resident_provider
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/resident_provider.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(llama_server_resident_provider PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77 LABELS llama_server)
