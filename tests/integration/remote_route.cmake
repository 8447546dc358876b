# remote_route: kvshare-serve --prefill-remote with kvshare-provider-server, the KV moved
# over UCX (tcp) into serve's kvshare-remote-receiver: on loopback, and as root across two
# network namespaces joined by a veth pair (skipped with a message when not root); each with
# kvshare-decoder and with the patched llama-server (LLAMA_SERVER_KVSHARE) as the decoder.
# Exit 77 = skipped.
foreach(decoder kvshare-decoder llama-server)
  set(suffix "")
  if(decoder STREQUAL "llama-server")
    set(suffix "_llama_server")
  endif()
  foreach(mode loopback netns)
    add_test(NAME remote_route_${mode}${suffix}
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/remote_route.py ${CMAKE_BINARY_DIR}/bin
                     ${CMAKE_BINARY_DIR}/tests --${mode})
    set_tests_properties(remote_route_${mode}${suffix} PROPERTIES TIMEOUT 1200 SKIP_RETURN_CODE 77 LABELS remote
                         RUN_SERIAL TRUE ENVIRONMENT "REMOTE_ROUTE_DECODER=${decoder}")
  endforeach()
endforeach()
