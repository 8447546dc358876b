# resident_llama_provider: issue #24's resident provider, llama-kvshare-prefill --serve PATH
# and --serve-fd N, driven by the test as kvshare-serve would, against a llama-server built
# with the patch series (LLAMA_SERVER_KVSHARE=path). Exit 77 = skipped (no such server).
add_test(NAME resident_llama_provider
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/resident_llama_provider.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(resident_llama_provider PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77)
